"""Speedup-vs-workers plots, one panel per model, with the ideal linear line."""

from __future__ import annotations


def plot_speedups(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    figure, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.8), squeeze=False)
    for axis, model in zip(axes[0], models, strict=True):
        workers = sorted({r["workers"] for r in rows if r["model"] == model})
        axis.plot(workers, workers, color="grey", linestyle=":", label="linear")
        for policy in policies:
            points = sorted(
                (r["workers"], r["speedup"])
                for r in rows
                if r["model"] == model and r["policy"] == policy
            )
            axis.plot(*zip(*points, strict=True), marker="o", label=policy)
        axis.set_title(model)
        axis.set_xlabel("workers")
        axis.set_ylabel("speedup T(1)/T(n)")
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
