"""`gradsum bench train`'s table: ratios to the first row, and the plan each scheduler chose;
rows written as they end, and a failed run recorded with its error while the rest run."""

import dataclasses
import json
import signal
import subprocess
import sys

import pytest

from gradsum.bench import train as bench_train
from gradsum.bench import train_testbed
from gradsum.bench.train import TrainRow, format_table
from gradsum.cli import build_parser, main
from gradsum.failures import Failure, WorkerFailed
from gradsum.testbed.shell import TestbedError
from gradsum.train import launch
from gradsum.train.methods import method_fields, method_name, parse_methods


def _row(scheduler: str, samples_per_s: float, plan: str = "") -> TrainRow:
    return TrainRow(
        method=f"ps:none/{scheduler}",
        aggregator="ps",
        codec="none",
        scheduler=scheduler,
        model="alexnet",
        workers=4,
        epochs=1,
        samples_per_s=samples_per_s,
        test_accuracy=0.5,
        train_seconds=10.0,
        plan=plan,
    )


def test_rows_show_their_ratio_to_the_first_and_the_plan_each_ran():
    rows = [_row("default", 20.0, "plan default: 8 groups"), _row("imerge", 25.0, "plan imerge")]
    lines = format_table(rows).splitlines()
    assert lines[2].split()[-2:] == ["1.00x", "0.5000"]
    assert lines[3].split()[-2:] == ["1.25x", "0.5000"]
    assert lines[4:] == [
        "plans:",
        "  ps:none/default: plan default: 8 groups",
        "  ps:none/imerge: plan imerge",
    ]


def test_a_run_without_test_accuracy_shows_its_loss(capsys):
    """A run of the gpt model reports a loss, not an accuracy: its validation loss when it
    ran by steps."""
    row = dataclasses.replace(_row("imerge", 25.0), test_accuracy=None, final_loss=2.5)
    assert format_table([row]).splitlines()[2].split()[-2:] == ["1.00x", "-"]
    bench_train._Rows(None).add(row)
    bench_train._Rows(None).add(dataclasses.replace(row, val_loss=2.25))
    out = capsys.readouterr().out
    assert "ps:none/imerge: 25 samples/s, final loss 2.5000 (10.0 s training)" in out
    assert "ps:none/imerge: 25 samples/s, validation loss 2.2500 (10.0 s training)" in out


def test_rows_without_a_plan_print_no_plan_section():
    assert "plans:" not in format_table([_row("wfbp", 20.0)])


def _failed(scheduler: str) -> TrainRow:
    row = _row(scheduler, 0.0)
    row.samples_per_s = row.test_accuracy = row.train_seconds = None
    row.error = Failure("NonFiniteGradientError", "gradient of 1290 coordinates", rank=1)
    return row


def test_a_failed_row_shows_as_failed_and_the_first_that_ran_is_the_baseline():
    lines = format_table([_failed("default"), _row("wfbp", 20.0), _row("imerge", 25.0)])
    assert "vs ps:none/wfbp" in lines.splitlines()[1]
    assert lines.splitlines()[2].split() == ["ps:none/default", "failed", "-", "-"]
    assert lines.splitlines()[4].split()[-2:] == ["1.25x", "0.5000"]
    assert lines.splitlines()[-2:] == [
        "failed:",
        "  ps:none/default: worker 1 failed: NonFiniteGradientError: gradient of 1290 coordinates",
    ]


def test_bench_train_writes_each_row_as_it_ends_and_runs_on_past_a_failed_one(
    tmp_path, monkeypatch, capsys
):
    path = tmp_path / "rows.json"
    written_before = []

    def run_one(config):
        written_before.append(len(json.loads(path.read_text())) if path.exists() else 0)
        if config.codec == "thc" and config.aggregator == "ps":
            raise WorkerFailed(Failure("NonFiniteGradientError", "NaN in 4096 coordinates", 1))
        speed = {"allreduce:none": 100.0, "ddp:fp16": 150.0}[method_name(config)]
        return {"samples_per_s": speed, "test_accuracy": 0.9, "train_seconds": 2.0, "plan": ""}

    monkeypatch.setattr(launch, "run_local", run_one)
    methods = "allreduce:none,ps:thc,ddp:fp16"  # DDP's names as bench tta takes them
    argv = ["bench", "train", "--methods", methods]
    assert main([*argv, "--json", str(path)]) == 1
    assert written_before == [0, 1, 2]  # the file held every row before the next run began
    out = [line for line in capsys.readouterr().out.splitlines() if "training with" not in line]
    assert out[:3] == [
        "  allreduce:none/wfbp: 100 samples/s, test accuracy 0.9000 (2.0 s training)",
        "  ps:thc/wfbp: worker 1 failed: NonFiniteGradientError: NaN in 4096 coordinates",
        "  ddp:fp16/wfbp: 150 samples/s, test accuracy 0.9000 (2.0 s training)",
    ]
    assert out[6].split() == ["ps:thc/wfbp", "failed", "-", "-"]
    assert out[7].split()[-2:] == ["1.50x", "0.9000"]
    rows = json.loads(path.read_text())
    assert [r["method"] for r in rows] == [f"{m}/wfbp" for m in methods.split(",")]
    assert [r["error"] for r in rows[::2]] == [None, None]
    assert rows[1]["samples_per_s"] is None
    assert rows[1]["error"] == {
        "type": "NonFiniteGradientError",
        "message": "NaN in 4096 coordinates",
        "rank": 1,
        "traceback": "",
    }


def _base(args):
    """The configuration a ``bench train`` command line sets, before its methods and schedules."""
    from gradsum.config import given
    from gradsum.train.config import BENCH_SECTIONS, TrainConfig

    return TrainConfig(**{**bench_train.DEFAULTS, **given(args, BENCH_SECTIONS)})


def test_a_testbed_that_fails_fails_every_job_it_had_left(monkeypatch):
    refused = "gradsum switch on switch did not start: address in use"

    def jobs(aggregator, schedulers, **_):
        yield schedulers[0], {"samples_per_s": 1.0}
        raise TestbedError(refused)

    monkeypatch.setattr(train_testbed, "train_in_testbed", jobs)
    args = build_parser().parse_args(
        ["bench", "train", "--model", "digits-mlp", "--link-rate", "100mbit", "--workers", "2"]
    )
    outcomes = list(bench_train._testbed_outcomes(args, _base(args), method_fields("switch:thc"),
                                                  ["a", "b", "c"]))  # fmt: skip
    assert [scheduler for scheduler, _ in outcomes] == ["a", "b", "c"]
    assert outcomes[0][1] == {"samples_per_s": 1.0}
    assert outcomes[1][1] is outcomes[2][1]
    assert str(outcomes[1][1]) == f"TestbedError: {refused}"


def test_a_testbed_job_reports_the_first_worker_to_fail_and_stops_the_rest(tmp_path):
    failure = Failure("NonFiniteGradientError", "NaN", rank=1, traceback="Traceback ...")
    writes = (
        "import json, sys; "
        f"open({str(train_testbed._failure_file(str(tmp_path), 1))!r}, 'w')"
        f".write(json.dumps({failure.to_json()!r})); sys.exit(1)"
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),
        subprocess.Popen([sys.executable, "-c", writes]),
    ]
    with pytest.raises(WorkerFailed) as caught:
        train_testbed._wait(processes, str(tmp_path), timeout=60)
    assert caught.value.failure == failure
    assert processes[0].returncode == -signal.SIGKILL  # stopped, not reported


def test_a_testbed_worker_that_crashes_is_reported_by_its_signal_and_stderr(tmp_path):
    (tmp_path / "w0.err").write_text("Fatal Python error: Aborted\n\nCurrent thread ...\n")
    crash = subprocess.Popen([sys.executable, "-c", "import os; os.abort()"])
    with pytest.raises(WorkerFailed) as caught:
        train_testbed._wait([crash], str(tmp_path), timeout=60)
    assert str(caught.value) == (
        "worker 0 failed: killed by SIGABRT: Fatal Python error: Aborted\n    Current thread ..."
    )


def test_a_testbed_job_of_a_ddp_method_gets_its_hook(monkeypatch):
    seen = {}

    def jobs(aggregator, schedulers, *, train_flags, **_):
        seen.update(aggregator=aggregator, flags=train_flags)
        yield schedulers[0], {"samples_per_s": 1.0}

    monkeypatch.setattr(train_testbed, "train_in_testbed", jobs)
    args = build_parser().parse_args(["bench", "train", "--model", "gpt", "--dataset", "stdlib",
                                      "--batch-size", "1", "--link-rate", "100mbit",
                                      "--layers", "3", "--max-steps", "20"])  # fmt: skip
    fields = parse_methods("ddp:powersgd4")[0][1]
    list(bench_train._testbed_outcomes(args, _base(args), fields, ["fusion"]))
    flags = " ".join(seen["flags"])
    assert seen["aggregator"] == "ddp"
    assert "--ddp-hook powersgd" in flags and "--powersgd-rank 4" in flags
    assert "--layers 3" in flags and "--max-steps 20" in flags  # the workload's own flags


def test_rounds_play_the_schedulers_again_in_reversed_order_and_rows_carry_their_round(
    tmp_path, monkeypatch, capsys
):
    assert bench_train.played_order(["a", "b", "c"], 3) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (2, "c"),
    ]  # fmt: skip
    played = []

    def run_one(config):
        played.append(config.scheduler)
        return {"samples_per_s": 10.0 * len(played), "test_accuracy": 0.9, "train_seconds": 1.0}

    monkeypatch.setattr(launch, "run_local", run_one)
    path = tmp_path / "rows.json"
    argv = ["bench", "train", "--methods", "ps:none", "--schedulers", "wfbp,fusion(threshold=9)"]
    assert main([*argv, "--rounds", "2", "--json", str(path)]) == 0
    assert played == ["wfbp", "fusion(threshold=9)", "fusion(threshold=9)", "wfbp"]
    rows = json.loads(path.read_text())
    assert [(r["scheduler"], r["round"], r["samples_per_s"]) for r in rows] == [
        ("wfbp", 0, 10.0), ("fusion(threshold=9)", 0, 20.0),
        ("fusion(threshold=9)", 1, 30.0), ("wfbp", 1, 40.0),
    ]  # fmt: skip
    table = capsys.readouterr().out
    assert "ps:none/wfbp #2" in table and "ps:none/fusion(threshold=9) #1" in table


def test_a_stopped_bench_says_how_many_runs_it_kept(tmp_path, monkeypatch, capsys):
    def run_one(config):
        if config.scheduler == "imerge":
            raise KeyboardInterrupt
        return {"samples_per_s": 10.0, "test_accuracy": 0.9, "train_seconds": 1.0}

    monkeypatch.setattr(launch, "run_local", run_one)
    path = tmp_path / "rows.json"
    argv = ["bench", "train", "--methods", "ps:none", "--schedulers", "wfbp,imerge,merge"]
    assert main([*argv, "--json", str(path)]) == 130
    assert f"stopped with 1 of 3 runs done, kept in {path}" in capsys.readouterr().err
    assert [r["scheduler"] for r in json.loads(path.read_text())] == ["wfbp"]
