"""The seed score's arithmetic on a hand-made table (the real one is minutes of simulation)."""

import math

import pytest

from gradsum.sim.score import (
    MODELS,
    SCORED_POLICIES,
    SEED_GAIN_OVER_DEFAULT,
    SEED_MERGE_OVER_FUSION,
    WORKERS,
    findings,
    format_score,
    implied_default_efficiency,
    loss,
    order_penalty,
    order_steps,
)


def seed_exact_table(default_efficiency=0.25):
    """Throughputs that reproduce every seed percentage exactly."""
    table = {}
    for i, model in enumerate(MODELS):
        default = default_efficiency * WORKERS
        merge = default * (1 + SEED_GAIN_OVER_DEFAULT["merge"][i])
        speeds = {
            "default": default,
            "wfbp": default * (1 + SEED_GAIN_OVER_DEFAULT["wfbp"][i]),
            "merge": merge,
            "imerge": default * (1 + SEED_GAIN_OVER_DEFAULT["imerge"][i]),
            "fusion": merge / (1 + SEED_MERGE_OVER_FUSION[i]),
        }
        for policy in SCORED_POLICIES:
            table[(model, WORKERS, policy)] = {
                "throughput": speeds[policy],
                "efficiency": speeds[policy] / WORKERS,
            }
            table[(model, 1, policy)] = {"throughput": 1.0, "efficiency": 1.0}
    return table


def test_a_table_with_the_seeds_numbers_scores_only_its_efficiencies():
    found = findings(seed_exact_table(0.25))
    assert len(found) == 16 + 4
    gains = [f for f in found if f.kind == "gain"]
    assert all(f.loss == pytest.approx(0, abs=1e-24) for f in gains)
    # 25% default efficiency: under the ≤ bounds (ResNets), near the stated ones.
    vgg = next(f for f in found if f.name == "vgg16 default efficiency")
    assert vgg.loss == pytest.approx(math.log(0.25 / (1 / 3.115)) ** 2)
    resnet50 = next(f for f in found if f.name == "resnet50 default efficiency")
    assert resnet50.kind == "efficiency ≤" and resnet50.loss == 0
    assert loss(found) == pytest.approx(sum(f.loss for f in found))
    assert "loss" in format_score(seed_exact_table(), found, "test")


def test_a_gain_off_by_a_factor_of_1_5_costs_its_squared_log():
    table = seed_exact_table()
    table[("vgg16", WORKERS, "imerge")]["throughput"] = (
        table[("vgg16", WORKERS, "default")]["throughput"] * (1 + 2.115) / 1.5
    )
    imerge = next(f for f in findings(table) if f.name == "vgg16 imerge over default")
    assert imerge.ratio == pytest.approx(1 / 1.5)
    assert imerge.loss == pytest.approx(math.log(1.5) ** 2)
    assert imerge.within_1_5


def test_implied_default_efficiencies():
    assert implied_default_efficiency("resnet18") == (pytest.approx(1 / 1.844), "efficiency ≤")
    assert implied_default_efficiency("alexnet") == (pytest.approx(0.5 / 2.009), "efficiency")


def test_simulate_score_prints_the_table_the_loss_and_the_fitted_values(monkeypatch, capsys):
    from gradsum.cli import main
    from gradsum.sim import score

    monkeypatch.setattr(score, "score_tables", fake_tables)
    assert main(["simulate", "--preset", "imerge-seed-fit", "--score", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "vgg16 imerge over default" in out and "loss " in out
    assert "fitted parameters: alpha_worker" in out
    assert "16 of 16 as throughput ratios, 15 of 15 as percentages" in out
    assert "pieces ≤1,024,000" in out and "pieces ≤8,000,000" in out and "whole" in out
    resnet50 = next(
        line
        for line in out.splitlines()
        if line.startswith("resnet50")
        and "%" in line
        and "×" in line
        and "efficiency" not in line
        and "over" not in line
    )
    assert "-50.0%" in resnet50  # priority at half of default's speed


def fake_tables(preset, processes=1):
    return seed_exact_table(), fake_placements(preset), fake_priority(preset)


def test_score_tables_runs_every_cell_once_and_files_each_row_where_it_belongs(monkeypatch):
    from gradsum.sim import score
    from gradsum.sim.presets import get_preset

    cells_run = []

    def fake_run(cells, processes=1):
        cells_run.extend(cells)
        return [
            {"throughput": {"whole": 1.0, "pieces": 2.0}[preset.placement]
             + (preset.partition_elements == 8_000_000) * 10 + (policy == "priority") * 100,
             "cell": (preset.placement, model, n, policy)}
            for preset, model, n, policy in cells
        ]  # fmt: skip

    monkeypatch.setattr(score, "run_cells", fake_run)
    prototype = get_preset("imerge-prototype")  # places whole: that column is its own table
    table, placed, priority = score.score_tables(prototype)
    assert len(cells_run) == len(set((id(c[0]), *c[1:]) for c in cells_run))
    assert len(cells_run) == 4 * 2 * 5 + 2 * 4 * 4 + 4  # scored, two other placements, priority
    assert {r["throughput"] for r in table.values()} == {1.0}
    assert {r["throughput"] for r in placed["whole"].values()} == {1.0}
    assert {r["throughput"] for r in placed["pieces ≤1,024,000"].values()} == {2.0}
    assert {r["throughput"] for r in placed["pieces ≤8,000,000"].values()} == {12.0}
    assert set(placed["pieces ≤8,000,000"]) == {
        (m, score.WORKERS, p) for m in score.MODELS for p in score.PLACED_POLICIES
    }
    assert {r["throughput"] for r in priority.values()} == {101.0}
    assert len(priority) == 4


def fake_priority(preset, processes=1):
    """Priority at half of default's speed on every model."""
    table = seed_exact_table()
    return {
        (m, WORKERS, "priority"): {
            "throughput": table[(m, WORKERS, "default")]["throughput"] / 2,
            "efficiency": 0.1,
        }
        for m in MODELS
    }


def fake_placements(preset, processes=1, table=None):
    """Each placement's rows: the seed's table with every baseline twice as fast as default's
    (whole), or as the seed has it (pieces)."""
    out = {}
    for label in ("whole", "pieces ≤1,024,000", "pieces ≤8,000,000"):
        rows = {k: dict(v) for k, v in seed_exact_table().items() if k[1] == WORKERS}
        if label == "whole":
            for model in MODELS:
                base = rows[(model, WORKERS, "default")]["throughput"]
                for policy in ("wfbp", "fusion", "merge"):
                    rows[(model, WORKERS, policy)]["throughput"] = 2 * base
        out[label] = rows
    return out


def test_the_prototype_score_names_its_measured_values(monkeypatch, capsys):
    from gradsum.cli import main
    from gradsum.sim import score

    monkeypatch.setattr(score, "score_tables", fake_tables)
    assert main(["simulate", "--preset", "imerge-prototype", "--score", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "measured parameters: alpha_worker" in out and "ps-core" in out


def test_a_gain_is_within_1_5_as_a_throughput_ratio_but_not_as_a_percentage():
    table = seed_exact_table()
    # ResNet18 imerge at +189 % against the seed's +84.4 %: 1.57x as throughput, 2.24x as %
    table[("resnet18", WORKERS, "imerge")]["throughput"] = (
        table[("resnet18", WORKERS, "default")]["throughput"] * 2.89
    )
    found = next(f for f in findings(table) if f.name == "resnet18 imerge over default")
    assert found.ratio == pytest.approx(2.89 / 1.844)
    assert found.percent_ratio == pytest.approx(1.89 / 0.844)
    assert not found.within_1_5 and not found.within_1_5_percent
    table[("resnet18", WORKERS, "imerge")]["throughput"] = (
        table[("resnet18", WORKERS, "default")]["throughput"] * 2.6
    )  # 1.41x as throughput, 1.90x as percentages
    found = next(f for f in findings(table) if f.name == "resnet18 imerge over default")
    assert found.within_1_5 and not found.within_1_5_percent
    zero = next(f for f in findings(table) if f.name == "resnet50 merge over fusion")
    assert zero.percent_ratio is None and zero.within_1_5_percent is None


def test_the_placement_table_shows_each_placements_gains_beside_the_seeds():
    from gradsum.sim.presets import get_preset
    from gradsum.sim.score import format_placements

    table = seed_exact_table()
    text = format_placements(table, fake_placements(None), get_preset("imerge-prototype"))
    vgg_wfbp = next(line for line in text.splitlines() if "vgg16 wfbp over default" in line)
    # seed +61.1 %; whole: +100.0 % (×2.000); pieces: the seed's own
    assert vgg_wfbp.count("+61.1%") == 3 and "+100.0%" in vgg_wfbp and "×2.000" in vgg_wfbp
    assert "places them whole" in text
    assert "imerge over the fastest baseline of any placement" in text


def test_the_order_holds_where_each_step_is_3_percent_and_a_tie_costs_a_factor_1_5():
    steps = order_steps(seed_exact_table())
    assert len(steps) == 4 * 4
    # The seed's own numbers: every step holds but merge over fusion on AlexNet (+2.1%) and on
    # ResNet50 ("close": 0); the tie costs exactly what a percentage off by 1.5 does.
    missed = {(s.model, s.faster) for s in steps if not s.holds}
    assert missed == {("alexnet", "merge"), ("resnet50", "merge")}
    tie = next(s for s in steps if s.model == "resnet50" and s.faster == "merge")
    assert tie.ratio == pytest.approx(1.0) and tie.penalty == pytest.approx(math.log(1.5) ** 2)
    alexnet = next(s for s in steps if s.model == "alexnet" and s.faster == "merge")
    assert 0 < alexnet.penalty < tie.penalty
    assert order_penalty(steps) == pytest.approx(tie.penalty + alexnet.penalty)
    table = seed_exact_table()
    table[("vgg16", WORKERS, "imerge")]["throughput"] = (
        table[("vgg16", WORKERS, "merge")]["throughput"] * 0.97
    )  # a reversal costs more than a tie
    reversed_step = next(
        s for s in order_steps(table) if s.model == "vgg16" and s.faster == "imerge"
    )
    assert reversed_step.penalty > tie.penalty
    assert "order: 14 of 16 steps hold" in format_score(seed_exact_table(), findings(table), "t")
