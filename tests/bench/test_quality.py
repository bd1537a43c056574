"""`gradsum bench quality`: the plateau detector, the median and gap report, resuming from the
JSON, choosing configurations; one tiny sweep through the real launcher."""

import argparse
import json

import pytest

from gradsum.bench import quality, tta
from gradsum.cli import UsageError, build_parser, main


def _evals(losses, every=25):
    return [{"step": every * i, "seconds": float(i), "val_loss": loss, "val_accuracy": 0.0}
            for i, loss in enumerate(losses)]  # fmt: skip


def _row(method, seed, losses, every=25):
    evals = _evals(losses, every)
    return tta.TTARow(method, "loopback", 4, seed, steps=evals[-1]["step"],
                      final_val_loss=losses[-1], evals=evals)  # fmt: skip


def _run(config, method, seed, losses, every=25):
    return quality.Run(config, f"{config} in words", ["--max-steps", "200"],
                       _row(method, seed, losses, every))  # fmt: skip


FALLING = [5.0, 4.0, 3.6, 3.4, 3.3, 3.2, 3.1, 3.0, 2.9]  # every 25 steps, to step 200


def test_a_flat_curve_beside_a_falling_baseline_is_a_plateau():
    # learns to step 50, then flat (within 0.1 %) for 150 steps while the baseline falls 15 %
    stalled = [5.0, 4.0, 3.6, 3.599, 3.598, 3.6, 3.597, 3.598, 3.597]
    found = quality.plateau(_evals(stalled), _evals(FALLING))
    assert found is not None
    # the window where the baseline outpaced it most: steps 50-200 (3.6 -> 2.9 against flat)
    assert (found["start"], found["end"]) == (50, 200)
    assert found["change_pct"] == pytest.approx((3.597 / 3.6 - 1) * 100)
    assert found["baseline_change_pct"] == pytest.approx((2.9 / 3.6 - 1) * 100)


def test_a_curve_falling_with_the_baseline_is_no_plateau():
    slower = [5.0, 4.1, 3.7, 3.5, 3.4, 3.3, 3.2, 3.1, 3.0]  # a gap, but it learns all along
    assert quality.plateau(_evals(slower), _evals(FALLING)) is None


def test_a_flat_baseline_flags_nothing():
    flat = [3.0, 2.999, 3.001, 3.0, 2.998, 3.0, 2.999, 3.0, 3.001]
    assert quality.plateau(_evals(flat), _evals(flat)) is None
    rising = [3.0, 3.1, 3.2, 3.3, 3.4, 3.5, 3.6, 3.7, 3.8]
    assert quality.plateau(_evals(rising), _evals(flat)) is None


def test_a_plateau_needs_a_window_of_plateau_window_steps():
    # flat for one 25-step interval only, the baseline falling 3 % there
    run = [5.0, 4.0, 3.6, 3.6, 3.3]
    base = [5.0, 4.0, 3.6, 3.49, 3.3]
    assert quality.plateau(_evals(run), _evals(base)) is None
    # the same over 50 steps (evaluations every 50) is one
    found = quality.plateau(_evals(run, every=50), _evals(base, every=50))
    assert (found["start"], found["end"]) == (100, 150)
    assert quality.plateau(_evals(run, every=50), _evals(base, every=50), window=100) is None


def test_medians_and_gaps_at_the_last_common_step_against_hand_computed_numbers():
    runs = [
        # seed 0 of the baseline evaluated only to step 50: the common step is 50
        _run("a", "ddp", 0, [5.0, 4.0, 3.0]),
        _run("a", "thc", 0, [5.0, 4.0, 3.3, 3.0]),
        _run("a", "ddp", 1, [5.0, 4.0, 3.2, 3.1]),
        _run("a", "thc", 1, [5.0, 4.0, 3.2, 3.1]),
        _run("a", "ddp", 2, [5.0, 4.0, 3.1, 3.0]),
        _run("a", "thc", 2, [5.0, 4.0, 3.72, 3.5]),
        _run("b", "ddp", 0, [2.0, 1.0]),
        _run("b", "thc", 0, [2.0, 1.01]),
    ]
    diverged = tta.Failure.of(RuntimeError("diverged"))
    runs.append(quality.Run("b", "b", [], tta.TTARow("thc", "loopback", 4, 1, error=diverged)))
    summary = quality.report(runs, "ddp", max_gap=5.0)
    a, b = summary["configs"]
    assert a["step"] == 50 and b["step"] == 25
    ddp, thc = a["methods"]
    # at step 50: ddp 3.0, 3.2, 3.1 (median 3.1); thc 3.3, 3.2, 3.72 (median 3.3)
    assert ddp["median"] == pytest.approx(3.1) and thc["median"] == pytest.approx(3.3)
    assert thc["gap_pct"] == pytest.approx((3.3 / 3.1 - 1) * 100)  # +6.45 %
    assert [s["gap_pct"] for s in thc["seeds"]] == pytest.approx([10.0, 0.0, 20.0])
    _, thc_b = b["methods"]
    assert thc_b["gap_pct"] == pytest.approx(1.0)
    assert [(s["seed"], s["failed"]) for s in thc_b["seeds"]] == [(0, False), (1, True)]
    assert summary["worst"] == {"thc": {"gap_pct": pytest.approx(6.4516, abs=1e-3),
                                        "config": "a"}}  # fmt: skip
    assert [(o["method"], o["config"]) for o in summary["over_max_gap"]] == [("thc", "a")]
    assert summary["failed"] == [{"config": "b", "method": "thc", "seed": 1}]
    assert summary["plateaus"] == []
    table = quality.format_report(summary)
    line = next(x for x in table.splitlines() if x.strip().startswith("thc") and "+20.0%" in x)
    assert line.split()[1:6] == ["3.3000", "+6.5%", "+10.0%", "+0.0%", "+20.0%"]
    assert "worst median gap to ddp: thc +6.5% (a)" in table
    assert "over --max-gap 5%: thc +6.5% (a)" in table
    assert "failed: b thc seed 1" in table


def _fake_runs(monkeypatch, curves=None, fail=()):
    """Replace the training: each call counted, its row from ``curves`` (method -> losses
    every 25 steps) or a steady fall; the methods in ``fail`` fail."""
    calls = []

    def fake(name, config):
        calls.append((config.model, config.layers, config.optimizer, config.batch_size, name,
                      config.seed))  # fmt: skip
        if name in fail:
            return tta.TTARow(name, "loopback", config.workers, config.seed,
                              error=tta.Failure.of(RuntimeError("diverged")))  # fmt: skip
        losses = (curves or {}).get(name, [5.0 - 0.2 * i for i in range(9)])
        return _row(name, config.seed, losses)

    monkeypatch.setattr(tta, "run_method", fake)
    return calls


def test_a_sweep_resumes_from_its_json_running_only_what_is_missing(tmp_path, monkeypatch,
                                                                   capsys):  # fmt: skip
    calls = _fake_runs(monkeypatch)
    path = tmp_path / "quality.json"
    sweep = ["bench", "quality", "--configs", "gpt6x192-adamw-b1,digits-cnn-sgd-b8",
             "--methods", "ddp,allreduce:thc", "--json", str(path)]  # fmt: skip
    assert main([*sweep, "--seeds", "0,1"]) == 0
    assert len(calls) == 8  # 2 configurations x 2 seeds x 2 methods
    assert calls[0] == ("gpt", 6, "adamw", 1, "ddp", 0)
    assert calls[-1] == ("digits-cnn", 4, "sgd", 8, "allreduce:thc", 1)
    document = json.loads(path.read_text())
    assert len(document["rows"]) == 8 and document["baseline"] == "ddp"
    configs = [c["config"] for c in document["report"]["configs"]]
    assert configs == ["gpt6x192-adamw-b1", "digits-cnn-sgd-b8"]
    assert main([*sweep, "--seeds", "0,1"]) == 0
    assert len(calls) == 8  # every run was in the file
    assert "kept from" in capsys.readouterr().out
    assert main([*sweep, "--seeds", "0,1,2"]) == 0
    assert [call[-1] for call in calls[8:]] == [2, 2, 2, 2]  # only seed 2's
    assert len(json.loads(path.read_text())["rows"]) == 12
    # the same runs with other settings would mix two sweeps in one report: refused
    with pytest.raises(SystemExit):
        main([*sweep, "--seeds", "0", "--max-steps", "100"])
    assert "--max-steps 100" in capsys.readouterr().err
    assert len(calls) == 12


def test_failed_runs_are_run_again_and_fail_the_command(tmp_path, monkeypatch):
    path = tmp_path / "quality.json"
    sweep = ["bench", "quality", "--configs", "gpt2x128-sgd-b8", "--methods",
             "ddp,allreduce:thc", "--seeds", "0", "--json", str(path)]  # fmt: skip
    calls = _fake_runs(monkeypatch, fail=("allreduce:thc",))
    assert main(sweep) == 1
    calls = _fake_runs(monkeypatch)
    assert main(sweep) == 0
    assert [call[-2] for call in calls] == ["allreduce:thc"]
    rows = json.loads(path.read_text())["rows"]
    assert [(r["method"], r["error"]) for r in rows] == [("ddp", None), ("allreduce:thc", None)]


def test_max_gap_plateaus_from_json_and_plot(tmp_path, monkeypatch, capsys):
    curves = {"ddp": FALLING, "allreduce:thc": [5.0, 4.0, 3.6, 3.6, 3.6, 3.6, 3.6, 3.6, 3.6],
              "ddp:powersgd4": [5.0, 4.0, 3.6, 3.41, 3.31, 3.21, 3.1, 3.01, 2.91]}  # fmt: skip
    _fake_runs(monkeypatch, curves)
    path, png = tmp_path / "quality.json", tmp_path / "quality.png"
    sweep = ["bench", "quality", "--configs", "gpt6x192-adamw-b1,gpt2x128-adamw-b8",
             "--methods", "ddp,allreduce:thc,ddp:powersgd4", "--seeds", "0,1",
             "--json", str(path), "--plot", str(png)]  # fmt: skip
    assert main(sweep) == 0  # no --max-gap: reported, not checked
    out = capsys.readouterr().out
    assert "allreduce:thc +24.1% (gpt6x192-adamw-b1)" in out  # 3.6 / 2.9
    assert "plateaus: 4 run(s)" in out  # thc, both configurations, both seeds
    thc = next(x for x in out.splitlines() if x.strip().startswith("allreduce:thc"))
    assert "seed 0 steps 50-200: +0.0% (ddp -19.4%)" in thc
    assert png.stat().st_size > 10_000
    assert main(["bench", "quality", "--from-json", str(path), "--max-gap", "1"]) == 1
    out = capsys.readouterr().out
    over = next(x for x in out.splitlines() if x.startswith("over --max-gap 1%"))
    assert "allreduce:thc +24.1%" in over and "ddp:powersgd4" not in over
    assert main(["bench", "quality", "--from-json", str(path), "--max-gap", "25"]) == 0


def test_configurations_are_chosen_by_name_and_unknown_names_refused(capsys):
    chosen = quality.select("digits-cnn-sgd-b8, gpt6x192-adamw-b1")
    assert [c.name for c in chosen] == ["gpt6x192-adamw-b1", "digits-cnn-sgd-b8"]  # grid order
    assert chosen[1].fields == {"model": "digits-cnn", "dataset": "digits", "optimizer": "sgd",
                                "lr": 0.1, "batch_size": 8, "momentum": 0.9}  # fmt: skip
    with pytest.raises(UsageError, match="no configuration gpt9x9-adamw-b1; the grid's are "
                                         "gpt6x192-adamw-b1, gpt6x192-sgd-b1, "):  # fmt: skip
        quality.select("gpt6x192-adamw-b1,gpt9x9-adamw-b1")
    with pytest.raises(UsageError, match="distinct"):
        quality.select("gpt6x192-adamw-b1,gpt6x192-adamw-b1")
    assert main(["bench", "quality", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == [c.name for c in quality.GRID]


def test_the_default_grid_spans_shapes_optimizers_and_batches():
    grid = quality.GRID
    assert len(grid) >= 6 and len({c.name for c in grid}) == len(grid)
    assert {c.optimizer for c in grid} == {"sgd", "adamw"}
    assert {1, 8} <= {c.batch_size for c in grid}
    assert any(c.model == "digits-cnn" for c in grid)
    assert len({(c.layers, c.width) for c in grid if c.model == "gpt"}) >= 4


def test_the_configurations_own_their_fields_so_no_flag_overrides_them():
    """Every other field has its declared flag, or the sweep that runs over it."""
    from gradsum.config import flags_of
    from gradsum.train.config import BENCH_SECTIONS

    parser = _quality_parser()
    options = {o for a in parser._actions for o in a.option_strings}
    for flag in flags_of(BENCH_SECTIONS):
        if flag.field in quality.NOT_OFFERED:
            assert flag.name not in options, flag.name
        else:
            assert flag.name in options or flag.setting.sweep in options, flag.name
    text = " ".join(parser.format_help().split())
    assert "train by steps, this many (default: 200)" in text
    assert "validation samples per evaluation (default: 256)" in text
    args = build_parser().parse_args(["bench", "quality"])
    assert args.methods == "ddp,allreduce:thc,allreduce:powersgd(rank=4),ddp:powersgd4"
    assert args.seeds == "0,1,2"
    assert "the first N steps go uncompressed" in text and "(default: 2)" in text
    with pytest.raises(SystemExit):
        main(["bench", "quality", "--lr", "0.5", "--list"])


def _quality_parser():
    parser = build_parser()
    for name in ("bench", "quality"):
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


@pytest.mark.slow
def test_a_tiny_sweep_through_the_launcher(tmp_path, monkeypatch, capsys):
    tiny = quality.Configuration("gpt", "adamw", 1e-3, 1, layers=1, width=32, heads=2)
    monkeypatch.setattr(quality, "GRID", (tiny,))
    path, png = tmp_path / "quality.json", tmp_path / "quality.png"
    assert main(["bench", "quality", "--workers", "2", "--max-steps", "10", "--eval-every", "5",
                 "--methods", "ddp,allreduce:thc", "--seeds", "0", "--context", "16",
                 "--data-bytes", "20000", "--eval-samples", "16", "--json", str(path),
                 "--plot", str(png)]) == 0  # fmt: skip
    document = json.loads(path.read_text())
    ran = [(r["method"], r["steps"]) for r in document["rows"]]
    assert ran == [("ddp", 10), ("allreduce:thc", 10)]
    assert [e["step"] for e in document["rows"][1]["evals"]] == [0, 5, 10]
    (config,) = document["report"]["configs"]
    assert config["config"] == "gpt1x32-adamw-b1" and config["step"] == 10
    assert config["methods"][1]["gap_pct"] is not None
    assert png.stat().st_size > 10_000
    assert "worst median gap to ddp: allreduce:thc" in capsys.readouterr().out


def test_one_seeds_flat_window_flags_that_run_but_not_the_configurations_median():
    base = [5.0, 4.0, 3.0, 2.5, 2.2]
    stalled_once = [5.0, 4.0, 4.0, 4.0, 2.2]  # flat over steps 25-75 on one seed only
    runs = [_run("c", "ddp", seed, base) for seed in (0, 1, 2)]
    runs += [_run("c", "thc", 0, stalled_once)]
    runs += [_run("c", "thc", seed, base) for seed in (1, 2)]
    summary = quality.report(runs, "ddp")
    assert [(p["method"], p["seed"]) for p in summary["plateaus"]] == [("thc", 0)]
    assert summary["median_plateaus"] == []
    # every seed flat over the same steps: the configuration stalls
    runs = [_run("c", "ddp", seed, base) for seed in (0, 1, 2)]
    runs += [_run("c", "thc", seed, stalled_once) for seed in (0, 1, 2)]
    stalled = quality.report(runs, "ddp")["median_plateaus"]
    assert [(p["method"], p["start"], p["end"]) for p in stalled] == [("thc", 25, 75)]
    assert "plateaus of a configuration's median over seeds: c thc steps 25-75" in (
        quality.format_report(quality.report(runs, "ddp"))
    )
