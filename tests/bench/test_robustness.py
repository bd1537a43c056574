import itertools
import json

import pytest

from gradsum.bench import robustness


def row(scheduler, speed, aggregator="ps", predicted=None, digest="abc"):
    return {"aggregator": aggregator, "scheduler": scheduler, "workers": 4,
            "samples_per_s": speed, "predicted_step_s": predicted,
            "parameter_digest": digest}  # fmt: skip


def test_the_report_compares_imerge_with_the_best_tuned_baseline(tmp_path, capsys):
    point = "digits-wide_1gbit_5ms"
    ps = [row("default", 20.0), row("wfbp", 30.0), row("imerge", 45.0, predicted=1.5),
          row("priority", 10.0)]  # fmt: skip
    (tmp_path / f"{point}_ps.json").write_text(json.dumps(ps))
    (tmp_path / f"{point}_fusion5000000.json").write_text(json.dumps([row("fusion", 50.0)]))
    (tmp_path / f"{point}_ddp.json").write_text(json.dumps([row("wfbp", 25.0, "ddp", digest="")]))
    robustness.main(["report", "--out", str(tmp_path), "--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert "imerge / best tuned PS baseline (fusion 5,000,000): 0.90" in out
    assert "imerge / DDP all-reduce (no injected delay): 1.80" in out
    assert "same parameters: True" in out
    assert "step 1.422 s, predicted 1.500 s" in out  # 4 workers x 16 / 45 samples/s
    assert (tmp_path / "p.png").stat().st_size > 0


def test_the_report_says_when_schedules_summed_differently(tmp_path, capsys):
    rows = [row("wfbp", 30.0), row("imerge", 40.0, digest="other")]
    (tmp_path / "m_1gbit_0ms_ps.json").write_text(json.dumps(rows))
    robustness.main(["report", "--out", str(tmp_path)])
    assert "same parameters: False" in capsys.readouterr().out


def test_priority_at_any_credit_is_a_tuned_baseline_and_ablations_are_not(tmp_path, capsys):
    rows = [row("wfbp", 30.0), row("priority(credit_elements=1000000)", 38.0),
            row("imerge(interleave=true)", 60.0), row("imerge", 40.0)]  # fmt: skip
    (tmp_path / "m_1gbit_0ms_ps.json").write_text(json.dumps(rows))
    robustness.main(["report", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "imerge / best tuned PS baseline (priority(credit_elements=1000000)): 1.05" in out


def test_the_schedules_of_a_map_keep_their_options():
    assert robustness._schedules("wfbp,imerge(interleave=true,window=group)") == [
        "wfbp",
        "imerge(interleave=true,window=group)",
    ]


def test_repeats_compare_medians_as_well_as_each_repeats_fastest_baseline(tmp_path, capsys):
    # wfbp, fusion and imerge alike (40, 38 and 40 in the median), each baseline the fastest
    # of its repeat by noise in one of them
    speeds = [(44.0, 36.0, 40.0), (36.0, 44.0, 40.0), (40.0, 38.0, 38.8)]
    for k, (wfbp, fusion, imerge) in enumerate(speeds):
        out = tmp_path / f"r{k}"
        out.mkdir()
        (out / "m_1gbit_0ms_ps.json").write_text(json.dumps([row("wfbp", wfbp),
                                                             row("imerge", imerge)]))  # fmt: skip
        (out / "m_1gbit_0ms_fusion10000.json").write_text(json.dumps([row("fusion", fusion)]))
    robustness.main(["report", "--out", *(str(tmp_path / f"r{k}") for k in range(3))])
    out = capsys.readouterr().out
    assert "same repeat: median 0.91 (0.91-0.97" in out  # each repeat's fastest: biased
    assert "imerge's median / the best baseline's median (wfbp): 1.00" in out


def test_the_median_step_is_a_second_speed_that_ignores_a_runs_stalls(tmp_path, capsys):
    # imerge's run stalled once (samples/s 30 against wfbp's 40) at the same median step
    for k in range(2):
        out = tmp_path / f"r{k}"
        out.mkdir()
        rows = [row("wfbp", 40.0) | {"median_step_s": 1.6},
                row("imerge", 30.0) | {"median_step_s": 1.6}]  # fmt: skip
        (out / "m_1gbit_0ms_ps.json").write_text(json.dumps(rows))
    robustness.main(["report", "--out", str(tmp_path / "r0"), str(tmp_path / "r1")])
    out = capsys.readouterr().out
    assert "step 2.133 s, median 1.600 s" in out  # 4 workers x 16 / 30 samples/s
    whole, median = out.split("at the median step")
    assert "imerge's median / the best baseline's median (wfbp): 0.75" in whole
    assert "imerge's median / the best baseline's median (wfbp): 1.00" in median
    assert robustness.speed({"workers": 4, "median_step_s": None}, "step") is None


def test_a_map_plays_static_fusion_in_the_same_rounds_as_the_other_schedules(tmp_path, monkeypatch):
    commands = []
    monkeypatch.setattr(robustness, "_run_to_the_end", lambda c: commands.append(c) or 0)
    robustness.main(["run", "--out", str(tmp_path), "--models", "m", "--delays", "0.005",
                     "--schedulers", "wfbp,imerge", "--thresholds", "10000,50000",
                     "--rounds", "4", "--no-ddp"])  # fmt: skip
    [command] = commands
    flags = {flag: value for flag, value in itertools.pairwise(command)
             if flag.startswith("--")}  # fmt: skip
    assert flags["--schedulers"] == "wfbp,imerge,fusion(threshold=10000),fusion(threshold=50000)"
    assert flags["--rounds"] == "4"
    # 4 workers' windows fit the 1 Gbit/s link's queue: 20 ms of its rate and 64 KiB
    assert flags["--window-bytes"] == str((125_000_000 // 50 + 65536) // 4)
    assert flags["--json"] == str(tmp_path / "m_1gbit_5ms_ps.json")


def test_rounds_of_one_folder_are_its_repeats(tmp_path, capsys):
    # drift: round 0 runs wfbp first on a fast host, round 1 runs it last on a slow one
    rows = [row("wfbp", 44.0) | {"round": 0}, row("imerge", 40.0) | {"round": 0},
            row("fusion(threshold=10000)", 36.0) | {"round": 0},
            row("fusion(threshold=10000)", 44.0) | {"round": 1},
            row("imerge", 40.0) | {"round": 1}, row("wfbp", 36.0) | {"round": 1}]  # fmt: skip
    (tmp_path / "m_1gbit_0ms_ps.json").write_text(json.dumps(rows))
    robustness.main(["report", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"### {tmp_path}, round 2" in out
    assert "imerge / best tuned PS baseline (fusion 10,000): 0.91" in out  # round 2's
    assert "m_1gbit_0ms: 2 repeats" in out
    assert "imerge's median / the best baseline's median (wfbp): 1.00" in out


def test_a_map_stops_when_its_bench_was_stopped(tmp_path, monkeypatch):
    commands = []

    def interrupted(command):
        commands.append(command)
        return 130  # Ctrl-C

    monkeypatch.setattr(robustness, "_run_to_the_end", interrupted)
    with pytest.raises(SystemExit, match=r"m_1gbit_0ms_ps\.json is not complete"):
        robustness.main(["run", "--out", str(tmp_path), "--models", "m", "--delays", "0,0.005",
                         "--no-ddp"])  # fmt: skip
    assert len(commands) == 1  # not the next point's


@pytest.mark.parametrize(("steps", "log"), [((0.008, 0.4), True), ((0.3, 0.4), False)])
def test_the_plot_goes_logarithmic_when_steps_span_more_than_ten_times(
    tmp_path, monkeypatch, steps, log
):
    import matplotlib.axes

    scales = []
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xscale", lambda _, s, **__: scales.append(s))
    run = {"samples_per_s": 64.0, "workers": 4, "schedule": "imerge"}  # a step of 1 s
    points = {f"p{k}": [{**run, "predicted_step_s": step, "samples_per_s": 64 / step}]
              for k, step in enumerate(steps)}  # fmt: skip
    robustness.plot(points, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
    assert scales == (["log"] if log else [])


def test_a_row_with_its_own_batch_size_is_timed_by_it():
    """`bench train` runs the gpt model at its own batch: its step is that batch's, not the
    map's 16 a worker."""
    gpt = {**row("imerge", 52.0), "batch_size": 8, "median_step_s": 0.5}
    assert robustness.step_seconds(gpt) == pytest.approx(4 * 8 / 52.0)
    assert robustness.speed(gpt, "step") == pytest.approx(4 * 8 / 0.5)
    old = {**row("imerge", 52.0), "median_step_s": 0.5}  # rows from before it was kept
    assert robustness.speed(old, "step") == pytest.approx(4 * 16 / 0.5)


def test_a_map_passes_its_train_flags_to_every_run_and_they_win(tmp_path, monkeypatch):
    from gradsum.cli import build_parser

    commands = []
    monkeypatch.setattr(robustness, "_run_to_the_end", lambda c: commands.append(c) or 0)
    robustness.main(["run", "--out", str(tmp_path), "--models", "gpt", "--dataset", "stdlib",
                     "--delays", "0.005", "--schedulers", "imerge", "--thresholds", "400000",
                     "--no-ddp", "--train-flags",
                     "--layers 16 --width 128 --max-steps 40 --batch-size 8"])  # fmt: skip
    [command] = commands
    args = build_parser().parse_args(command[command.index("bench") :])
    assert (args.model, args.dataset, args.layers, args.width) == ("gpt", "stdlib", 16, 128)
    assert (args.max_steps, args.batch_size) == (40, 8)  # the map's 16 overridden


def test_a_map_places_the_baselines_whole_and_leaves_imerge_and_priority_to_their_rules(
    tmp_path, monkeypatch, capsys
):
    commands = []
    monkeypatch.setattr(robustness, "_run_to_the_end", lambda c: commands.append(c) or 0)
    robustness.main(["run", "--out", str(tmp_path), "--models", "m", "--delays", "0",
                     "--schedulers", "default,wfbp(window=group),imerge,priority",
                     "--thresholds", "10000", "--placement", "whole", "--no-ddp"])  # fmt: skip
    [command] = commands
    assert command[command.index("--schedulers") + 1] == (
        "default(placement=whole),wfbp(window=group,placement=whole),imerge,priority,"
        "fusion(threshold=10000,placement=whole)"
    )
    # a schedule that names its placement keeps it; pieces is every policy's default
    assert robustness.placed("fusion(threshold=5,placement=pieces)", "whole") == (
        "fusion(threshold=5,placement=pieces)"
    )
    assert robustness.placed("merge", "pieces") == "merge"
    # the report tells the placements of static fusion apart
    (tmp_path / "m_1gbit_0ms_ps.json").write_text(json.dumps([
        row("fusion(threshold=10000,placement=whole)", 80.0),
        row("fusion(threshold=10000)", 100.0), row("imerge", 99.0)]))  # fmt: skip
    [[point]] = [list(r.values()) for r in robustness.load(tmp_path)]
    assert [r["schedule"] for r in point] == ["fusion 10,000, whole", "fusion 10,000", "imerge"]


def test_points_of_different_shard_counts_are_not_repeats_of_each_other(tmp_path):
    for shards in (2, 4):
        folder = tmp_path / f"s{shards}"
        folder.mkdir()
        (folder / "m_1gbit_5ms_ps.json").write_text(json.dumps(
            [dict(row("imerge", 10.0 * shards), shards=shards)]))  # fmt: skip
    [two], [four] = robustness.load(tmp_path / "s2"), robustness.load(tmp_path / "s4")
    assert list(two) == ["m_1gbit_5ms, 2 shards"] and list(four) == ["m_1gbit_5ms, 4 shards"]
