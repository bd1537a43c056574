"""`--resume` from a checkpoint that already holds every epoch says so, and starts no worker."""

import subprocess
import sys

import torch


def test_resuming_a_finished_run_says_there_is_nothing_to_train(tmp_path):
    checkpoint = tmp_path / "ckpt.pt"
    torch.save({"epoch": 4, "method": "allreduce:thc"}, checkpoint)  # epochs 0-4 done
    command = [sys.executable, "-m", "gradsum.cli", "train", "--aggregator", "allreduce",
               "--codec", "thc", "--resume", str(checkpoint)]  # fmt: skip
    done = subprocess.run([*command, "--epochs", "5"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        f"nothing to train: {checkpoint} holds 5 epochs and --epochs is 5, which counts them "
        "all; raise it to train more"
    )
