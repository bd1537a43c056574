"""The device script's training parts (`python -m gradsum.bench.gpu_check`), checked here where
no GPU is: the commands it runs are ones gradsum takes, its rows are THC's cost over fp32 of the
same schedule, and a run that fails is said and skipped, not averaged in."""

import json
import subprocess
from pathlib import Path

import pytest

from gradsum.bench import gpu_check
from gradsum.cli import build_parser
from gradsum.train.cli import job_config


@pytest.mark.parametrize("schedule", list(gpu_check.SCHEDULES))
@pytest.mark.parametrize("codec", ["none", "thc"])
def test_each_training_run_is_a_command_gradsum_takes(schedule, codec, tmp_path):
    args = build_parser().parse_args(
        gpu_check.train_command("cpu", codec, schedule, 40, tmp_path / "log")
    )
    config = job_config(args)
    assert (config.codec, config.scheduler, config.max_steps) == (codec, schedule, 40)
    assert (config.model, config.workers, config.aggregator) == ("gpt", 1, "allreduce")
    assert build_parser().parse_args(
        gpu_check.train_command("cuda", codec, schedule, 40, tmp_path / "log")
    ).device == "cuda"


@pytest.mark.parametrize("rate", ["1gbit", None])
def test_the_time_to_loss_run_is_a_command_gradsum_takes(rate, tmp_path):
    args = build_parser().parse_args(gpu_check.tta_command("cuda", 20, rate, tmp_path / "t"))
    assert args.device == "cuda" and args.workers == 4 and args.link_rate == rate
    assert args.methods == "ddp,ddp:bf16,ddp:powersgd4,switch:thc,allreduce:thc"
    assert args.time_budget == 20.0


def test_rows_are_thc_over_fp32_of_the_same_schedule_and_a_failed_run_is_skipped(tmp_path):
    """Bugs feared: the fp32 and THC logs swapped, a schedule's overhead taken against the
    other schedule's fp32, a failed run read as a row."""
    steps = {("wfbp", "none"): 0.050, ("wfbp", "thc"): 0.202,
             ("fusion", "none"): 0.049, ("fusion", "thc"): None}  # fmt: skip

    def run(args, timeout):
        log = Path(args[args.index("--log") + 1])
        schedule, codec = args[args.index("--scheduler") + 1], args[args.index("--codec") + 1]
        seconds = steps[(schedule, codec)]
        if seconds is None:
            return subprocess.CompletedProcess(args, 1, stdout="RuntimeError: out of memory")
        log.write_text(json.dumps({"event": "summary", "median_step_s": seconds}) + "\n")
        return subprocess.CompletedProcess(args, 0, stdout="")

    out = tmp_path / "rows.jsonl"
    rows = gpu_check.training(40, out, device="cpu", run=run)
    assert [(r["schedule"], round(r["overhead_ms"], 3)) for r in rows] == [("wfbp", 152.0)]
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows
