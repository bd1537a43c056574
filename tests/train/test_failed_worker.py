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
