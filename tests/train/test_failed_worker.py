"""A worker that fails is reported by its rank and the type and message of what it raised, on
the last line of `gradsum train`'s stderr, locally and under torchrun."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch.distributed as dist

from gradsum.failures import FAILURE_FILE_ENV, TRACEBACK_ENV

# At lr 1e9 the loss overflows within a few steps, and the divergence guard stops the run.
DIVERGING = ["--lr", "1e9", "--epochs", "1", "--aggregator", "allreduce", "--codec", "none"]
REFUSED = re.compile(
    r"gradsum train: worker \d failed: DivergenceError: training diverged at step \d+ with "
    r"allreduce:none: the loss is (nan|inf)"
)


def _train(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in (TRACEBACK_ENV, "RANK")}
    return subprocess.run(
        [sys.executable, "-m", "gradsum.cli", "train", *DIVERGING, *argv],
        capture_output=True,
        text=True,
        timeout=180,
        env={**environment, **env},
    )


@pytest.mark.slow
def test_a_local_worker_that_raises_is_named_with_its_exception():
    done = _train(["--workers", "2"])
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]  # a progress bar's \r ends a line too
    assert REFUSED.match(last), last
    assert last.endswith(f"({TRACEBACK_ENV}=1 shows where)")
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_a_torchrun_worker_that_raises_says_so_and_writes_its_failure(tmp_path):
    # torchrun's agent serves the store and its workers connect to it: so here, on a port this
    # process holds (a port found free and released could be taken before the worker bound it)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    path = tmp_path / "failure.json"
    done = _train(
        ["--workers", "1"],
        RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        **{FAILURE_FILE_ENV: str(path), TRACEBACK_ENV: "1"},
    )
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert REFUSED.match(last) and last.startswith("gradsum train: worker 0 failed:"), last
    assert "Traceback (most recent call last)" in done.stderr  # asked for
    failure = json.loads(path.read_text())
    assert (failure["type"], failure["rank"]) == ("DivergenceError", 0)
    assert "guard.diverged" in failure["traceback"]


@pytest.mark.slow
def test_a_healthy_fp32_run_is_not_stopped_by_one_noisy_batch_near_convergence():
    """The run that stopped at step 253 with a loss 4.1x its running mean of 0.06: near
    convergence single batches jump past the factor, and the guard lets them pass."""
    from gradsum.train.launch import run_local
    from gradsum.train.loop import TrainConfig

    summary = run_local(TrainConfig(workers=2, epochs=12, aggregator="allreduce", codec="none",
                                    progress=False))  # fmt: skip
    assert summary["steps"] == 12 * 44
    assert summary["test_accuracy"] > 0.95 and summary["fallbacks"] == 0


@pytest.mark.slow
def test_torchrun_passes_the_log_flag_to_gradsum_and_the_summary_is_written(tmp_path):
    """torchrun takes `--log` for an abbreviation of its own flags and refuses to start;
    `--log-file` reaches gradsum."""
    import shutil
    from pathlib import Path

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    log = tmp_path / "run.jsonl"
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}  # fmt: skip
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "gradsum.cli", "train",
         "--aggregator", "allreduce", "--codec", "thc", "--epochs", "1", "--batch-size", "64",
         "--no-progress", "--log-file", str(log)],
        capture_output=True, text=True, timeout=300, env=environment,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert events[-1]["event"] == "summary" and events[-1]["workers"] == 2
    assert events[-1]["method"] == "allreduce:thc"
