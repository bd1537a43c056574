"""`gradsum bench report DIR`: every JSON rendered by the bench that wrote it, told apart by its
shape; a tta file's target is its baseline's final loss; plots land in --plots (by default next
to the JSON); a file it cannot render fails the command, naming it, before anything is printed."""

import json
from dataclasses import asdict

import pytest

from gradsum.bench import quality, report, tta
from gradsum.cli import main


def _tta_row(method, seed, losses, step_s):
    evals = [{"step": 10 * i, "seconds": 10 * i * step_s, "val_loss": loss, "val_accuracy": 0.0}
             for i, loss in enumerate(losses)]  # fmt: skip
    return tta.TTARow(method, "100mbit", 4, seed, steps=evals[-1]["step"],
                      train_seconds=evals[-1]["seconds"], step_s=step_s, compute_s=0.05,
                      comm_to_compute=(step_s - 0.05) / 0.05, final_val_loss=losses[-1],
                      bits_per_byte=losses[-1] / 0.6931, bytes_per_step=1_000_000, fallbacks=0,
                      evals=evals)  # fmt: skip


# fp32 ends at 3.2 at step 30, 45 s; THC is below 3.2 at step 40, 20 s: 2.25x; the slow one
# never gets there
TTA_ROWS = [
    _tta_row("ddp", 0, [5.0, 4.0, 3.5, 3.2], 1.5),
    _tta_row("switch:thc", 0, [5.0, 4.2, 3.6, 3.3, 3.19, 3.1], 0.5),
    _tta_row("switch:bfp", 0, [5.0, 4.5, 4.0], 2.0),
]


def _quality_runs():
    def run(config, method, seed, losses):
        evals = [{"step": 50 * i, "seconds": float(i), "val_loss": loss, "val_accuracy": 0.0}
                 for i, loss in enumerate(losses)]  # fmt: skip
        row = tta.TTARow(method, "loopback", 4, seed, steps=evals[-1]["step"],
                         final_val_loss=losses[-1], evals=evals)  # fmt: skip
        return quality.Run(config, f"{config} in words", ["--max-steps", "200"], row)

    return [run("gpt2x128-adamw-b8", "ddp", seed, [5.0, 4.0, 3.0, 2.5, 2.2]) for seed in (0, 1)] + [
        run("gpt2x128-adamw-b8", "allreduce:thc", 0, [5.0, 4.1, 3.1, 2.6, 2.3]),
        run("gpt2x128-adamw-b8", "allreduce:thc", 1, [5.0, 4.0, 3.0, 2.5, 2.1]),
    ]


def _write_dir(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    (folder / "link.json").write_text(json.dumps([asdict(row) for row in TTA_ROWS]))
    quality.write(folder / "sweep.json", _quality_runs(), "ddp")
    return folder


def test_each_file_is_told_apart_by_its_shape():
    runs = _quality_runs()
    document = {"baseline": "ddp", "report": quality.report(runs, "ddp"),
                "rows": [run.record() for run in runs]}  # fmt: skip
    assert report.kind_of(json.loads(json.dumps(document, default=str))) == "quality"
    assert report.kind_of([asdict(row) for row in TTA_ROWS]) == "tta"
    # what other benches write, or nothing, is neither
    assert report.kind_of([]) is None
    assert report.kind_of({"rows": []}) is None  # a quality file always has its report
    assert report.kind_of([{"method": "gloo", "ms": 50.0}]) is None  # bench ate's rows
    assert report.kind_of([asdict(TTA_ROWS[0]), {"method": "x"}]) is None


def test_a_tta_files_target_is_its_baselines_final_loss_median_over_seeds():
    rows = [_tta_row("ddp", 0, [5.0, 3.4], 1.0), _tta_row("switch:thc", 0, [5.0, 2.0], 1.0),
            _tta_row("ddp", 1, [5.0, 3.2], 1.0), _tta_row("ddp", 2, [5.0, 3.3], 1.0)]  # fmt: skip
    assert report.tta_target(rows) == pytest.approx(3.3)  # not THC's 2.0, not the last row's
    failed = tta.TTARow("ddp", "100mbit", 4, 3, error=None)
    assert report.tta_target([*rows, failed]) == pytest.approx(3.3)  # no loss: not counted


def test_the_report_prints_each_benchs_from_json_output_and_writes_the_plots(tmp_path, capsys):
    folder = _write_dir(tmp_path)
    plots = tmp_path / "plots"
    assert main(["bench", "report", str(folder), "--plots", str(plots)]) == 0
    out = capsys.readouterr().out
    # the tta table with the baseline's final loss as target: THC 45 s / 20 s, bfp never
    rows = [tta.with_target(tta.row_from_dict(asdict(row)), 3.2) for row in TTA_ROWS]
    table = tta.format_table(rows, 3.2)
    assert table in out
    thc = next(line for line in table.splitlines() if line.startswith("switch:thc"))
    assert thc.split()[1:3] == ["20.0", "2.25x"]
    bfp = next(line for line in table.splitlines() if line.startswith("switch:bfp"))
    assert bfp.split()[1:3] == ["-", "-"]
    # the quality report as `bench quality --from-json` prints it
    runs, baseline = quality.load(folder / "sweep.json")
    assert quality.format_report(quality.report(runs, baseline)) in out
    # in name order, each under its file's name and kind
    assert out.index("== link.json (bench tta)") < out.index("== sweep.json (bench quality)")
    assert (plots / "link.png").stat().st_size > 10_000
    assert (plots / "sweep.png").stat().st_size > 10_000
    assert not list(folder.glob("*.png"))


def test_plots_go_next_to_the_json_by_default(tmp_path):
    folder = _write_dir(tmp_path)
    (folder / "sweep.json").unlink()
    assert main(["bench", "report", str(folder)]) == 0
    assert (folder / "link.png").exists()


def test_a_file_it_cannot_render_fails_the_command_naming_it(tmp_path, capsys):
    folder = _write_dir(tmp_path)
    (folder / "ate.json").write_text(json.dumps([{"method": "gloo", "ms": 50.0}]))
    with pytest.raises(SystemExit) as stopped:
        main(["bench", "report", str(folder), "--plots", str(tmp_path / "plots")])
    assert stopped.value.code == 2
    captured = capsys.readouterr()
    assert "ate.json" in captured.err and "quality, tta" in captured.err
    assert captured.out == ""  # read and checked before anything is printed
    (folder / "ate.json").write_text("{not json")
    with pytest.raises(SystemExit):
        main(["bench", "report", str(folder)])
    assert "ate.json: not readable JSON" in capsys.readouterr().err


def test_an_empty_or_missing_folder_is_an_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "report", str(tmp_path)])
    assert "holds no .json files" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "report", str(tmp_path / "nowhere")])
    assert "not a folder" in capsys.readouterr().err
