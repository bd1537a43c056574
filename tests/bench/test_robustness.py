import json

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
