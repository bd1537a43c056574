"""`python -m gradsum.bench.gpu_check`: what the GPU path must show, in one run of < 10 minutes.

1. The tests: tests/gpu (skipped without CUDA) and the CPU-side tests of the device path (no
   host sync in a THC round, every codec's round on the meta device, the Triton kernels under
   the interpreter, `--device`).
2. The codecs: THC and bfp encode + decode of one worker's gradient of 2**20 .. 2**26
   coordinates against a device copy of the same gradient, timed with CUDA events, THC with
   the fused Triton kernels (with its error feedback, as training runs it, and without) and
   on the torch path.
3. Training: `gradsum train --device cuda --model gpt` on one GPU, fp32 and THC, under WFBP (a
   round per gradient group) and fused into one group: THC's milliseconds a step over fp32.
4. Time to a loss: `gradsum bench tta --device cuda` with 4 workers sharing the GPU, at
   `--link-rate 1gbit` in the testbed (root; on loopback otherwise, said so): fp32 DDP, its
   bf16 and PowerSGD hooks, THC through the switch and through the all-reduce, a short budget
   each.

Each row is printed (and appended to ``--json-lines``) as soon as it is measured, so a run cut
short keeps what it had; without CUDA the parts that need it say so and are skipped.

Exit status: the tests' (0 when they pass or skip).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CPU_PARTS = (
    "tests/codecs/test_host_syncs.py",
    "tests/sync/test_device_paths.py",
    "tests/codecs/test_triton.py",
    "tests/train/test_device.py",
    "tests/codecs/test_launches.py",
)
GPU_TESTS = "tests/gpu"
PARTS = ("tests", "codecs", "train", "tta")

# part 3: the model the GPU measurements of docs/benchmarks.md use, and its two schedules
TRAIN_FLAGS = ("--model", "gpt", "--dataset", "stdlib", "--workers", "1",
               "--aggregator", "allreduce", "--no-progress")  # fmt: skip
SCHEDULES = {"wfbp": ("--scheduler", "wfbp"),
             "fusion": ("--scheduler", "fusion", "--fusion-elements", "8000000")}  # fmt: skip
# part 4: what a user on GPUs picks between, as `bench tta` spells it
TTA_METHODS = "ddp,ddp:bf16,ddp:powersgd4,switch:thc,allreduce:thc"


def run_tests(root: Path) -> int:
    """The GPU tests, then the CPU parts in a process of their own: the Triton tests set
    TRITON_INTERPRET=1 for their process, which would run the GPU's kernels interpreted."""
    status = 0
    for paths in ([GPU_TESTS], list(CPU_PARTS)):
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths]
        print("$", " ".join(command[2:]), flush=True)
        # every part runs whatever an earlier one returned: a failure must not hide the rest
        status = subprocess.run(command, cwd=root, check=False).returncode or status
    return status


def _median_ms(samples: list[float]) -> float:
    return 1000.0 * statistics.median(samples)


def benchmark(log_sizes: range, repeats: int, out: Path | None) -> None:
    import torch

    from ..codecs import make_codec
    from ..codecs.round import PhaseClock, run_round
    from .codecs import cuda_event_clock

    if not torch.cuda.is_available():
        print("no CUDA device: the GPU benchmark is skipped", flush=True)
        return
    device = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    print(f"{'codec':<24}{'size':>6}{'copy ms':>10}{'encode ms':>11}{'decode ms':>11}"
          f"{'(enc+dec)/copy':>16}", flush=True)  # fmt: skip
    clock = cuda_event_clock()
    # THC with its error feedback is what training runs (the feedback adds the transform of
    # x + e, the memory's bound and its update); without it, the codec alone.
    variants = [("thc", "1", True), ("thc", "1", False), ("thc", "0", False), ("bfp", "0", False)]
    for log in log_sizes:
        x = torch.randn(1 << log, device=device)
        buffer = torch.empty_like(x)
        copies = []
        for _ in range(repeats + 1):
            start = clock()
            buffer.copy_(x)
            copies.append(clock() - start)
        copy_ms = _median_ms(copies[1:])
        for name, triton, feedback in variants:
            os.environ["GRADSUM_TRITON"] = triton
            codec = make_codec(name, workers=1, error_feedback=feedback)
            encode, decode = [], []
            for step in range(repeats + 1):
                phases = PhaseClock(clock)
                run_round(codec, [x], step=step, clock=phases)
                if step:  # the first round builds tables, rotations and kernels
                    encode.append(phases.seconds["encode"])
                    decode.append(phases.seconds["decode"])
            label = f"{name}{'+triton' if name == 'thc' and triton == '1' else ''}"
            label += "+feedback" if feedback else ""
            row = {
                "codec": label, "size": 1 << log, "copy_ms": copy_ms, "feedback": feedback,
                "encode_ms": _median_ms(encode), "decode_ms": _median_ms(decode),
                "device": torch.cuda.get_device_name(device), "clock": "cuda-events",
            }  # fmt: skip
            ratio = (row["encode_ms"] + row["decode_ms"]) / copy_ms
            print(f"{label:<24}{'2^' + str(log):>6}{copy_ms:>10.3f}{row['encode_ms']:>11.3f}"
                  f"{row['decode_ms']:>11.3f}{ratio:>16.1f}", flush=True)  # fmt: skip
            _append(out, row)
        del x, buffer
        torch.cuda.empty_cache()
    os.environ.pop("GRADSUM_TRITON", None)


def profile(log_sizes: range, rows: int) -> None:
    """Where one THC round's time goes (fused kernels, error feedback as training runs it):
    torch.profiler over a warmed-up round
    of each size, the ops by their own device time and by their own host time, and the
    kernels' total against the round's wall time (a round far longer than its kernels is
    bound by launches and Python, not by the GPU)."""
    import time

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from ..codecs import make_codec
    from ..codecs.round import run_round

    if not torch.cuda.is_available():
        print("no CUDA device: the profile is skipped", flush=True)
        return
    os.environ["GRADSUM_TRITON"] = "1"
    codec = make_codec("thc", workers=1)
    for log in log_sizes:
        x = torch.randn(1 << log, device="cuda")
        for step in range(3):
            run_round(codec, [x], step=step)
        torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with torch_profile(activities=activities) as prof:
            start = time.perf_counter()
            run_round(codec, [x], step=3)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        events = prof.key_averages()
        # the kernels' own rows (an op's row repeats the time of the kernels it launched)
        device_us = sum(e.self_device_time_total for e in events
                        if e.device_type != DeviceType.CPU)  # fmt: skip
        launches = sum(e.count for e in events if e.key.startswith(("cudaLaunch", "cuLaunch")))
        print(f"\nthc+triton+feedback 2^{log}: round {wall * 1e3:.3f} ms wall, kernels "
              f"{device_us / 1e3:.3f} ms, {launches} launches", flush=True)  # fmt: skip
        for key in ("self_device_time_total", "self_cpu_time_total"):
            print(events.table(sort_by=key, row_limit=rows, max_name_column_width=60))
        del x
    os.environ.pop("GRADSUM_TRITON", None)


def train_command(device: str, codec: str, schedule: str, steps: int, log: Path) -> list[str]:
    """Part 3's `gradsum train` arguments for one codec and schedule."""
    return ["train", *TRAIN_FLAGS, "--device", device, "--codec", codec, *SCHEDULES[schedule],
            "--max-steps", str(steps), "--eval-every", str(steps), "--log", str(log)]  # fmt: skip


def tta_command(device: str, budget: float, link_rate: str | None, out: Path) -> list[str]:
    """Part 4's `gradsum bench tta` arguments."""
    rate = ["--link-rate", link_rate] if link_rate else []
    return ["bench", "tta", "--device", device, "--workers", "4", "--model", "gpt",
            "--dataset", "stdlib", "--methods", TTA_METHODS, "--time-budget", f"{budget:g}",
            "--eval-seconds", f"{budget / 4:g}", *rate, "--json", str(out)]  # fmt: skip


def _gradsum(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "gradsum.cli", *args]
    print("$ gradsum", " ".join(args), flush=True)
    return subprocess.run(command, timeout=timeout, check=False, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def _append(out: Path | None, row: dict) -> None:
    if out is not None:
        with out.open("a") as handle:
            handle.write(json.dumps(row) + "\n")


def median_step_ms(log: Path) -> float:
    """A `gradsum train --log` file's median step, from its summary (the last line)."""
    summary = json.loads(log.read_text().splitlines()[-1])
    if summary.get("event") != "summary":
        raise ValueError(f"{log} ends without its summary line")
    return 1000.0 * summary["median_step_s"]


def training(steps: int, out: Path | None, device: str = "cuda", run=_gradsum) -> list[dict]:
    """Part 3: fp32 and THC under each schedule; a row per schedule with THC's ms over fp32."""
    rows = []
    print(f"{'schedule':<10}{'fp32 ms':>10}{'thc ms':>10}{'thc - fp32':>12}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        for schedule in SCHEDULES:
            ms = {}
            for codec in ("none", "thc"):
                log = Path(scratch) / f"{schedule}-{codec}.jsonl"
                done = run(train_command(device, codec, schedule, steps, log), 300)
                if done.returncode != 0:
                    tail = done.stdout.strip().splitlines()[-5:]
                    print(f"  {codec} under {schedule} failed:", *tail, sep="\n    ", flush=True)
                    break
                ms[codec] = median_step_ms(log)
            if len(ms) < 2:
                continue
            row = {"part": "train", "schedule": schedule, "steps": steps, "device": device,
                   "fp32_ms": ms["none"], "thc_ms": ms["thc"],
                   "overhead_ms": ms["thc"] - ms["none"]}  # fmt: skip
            print(f"{schedule:<10}{row['fp32_ms']:>10.1f}{row['thc_ms']:>10.1f}"
                  f"{row['overhead_ms']:>12.1f}", flush=True)  # fmt: skip
            rows.append(row)
            _append(out, row)
    return rows


def testbed_possible() -> bool:
    """Whether the testbed can be built here (``testbed.shell.preflight``: root, ip, tc)."""
    from ..testbed.shell import TestbedError, preflight

    try:
        preflight()
    except TestbedError:
        return False
    return True


def time_to_loss(budget: float, out: Path | None, device: str = "cuda", run=_gradsum) -> int:
    """Part 4: `bench tta` as the GPU user would run it; its rows print as they come."""
    link_rate = "1gbit" if testbed_possible() else None
    if link_rate is None:
        print("no testbed here (root, ip, tc): part 4 runs on loopback, without --link-rate",
              flush=True)  # fmt: skip
    target = (out.with_suffix(".tta.json") if out is not None
              else Path(tempfile.mkdtemp()) / "tta.json")  # fmt: skip
    done = run(tta_command(device, budget, link_rate, target), 600)
    print(done.stdout, flush=True)
    return done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradsum.bench.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the repository (cwd)")
    parser.add_argument("--json-lines", type=Path, help="append each benchmark row here")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per row (median)")
    parser.add_argument("--largest", type=int, default=26, help="log2 of the largest size")
    parser.add_argument("--no-tests", action="store_true", help="every part but the tests")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="which parts to run (default: all)")  # fmt: skip
    parser.add_argument("--train-steps", type=int, default=40,
                        help="part 3: steps of each training run (default 40)")  # fmt: skip
    parser.add_argument("--tta-budget", type=float, default=20.0,
                        help="part 4: seconds of training per method (default 20)")  # fmt: skip
    parser.add_argument(
        "--profile", type=int, metavar="ROWS", default=0,
        help="then profile a THC round at 2^20 and 2^22 and print its top ROWS ops",
    )  # fmt: skip
    args = parser.parse_args(argv)
    parts = [p for p in args.parts if not (args.no_tests and p == "tests")]
    status = run_tests(args.root) if "tests" in parts else 0
    if "codecs" in parts:
        benchmark(range(20, args.largest + 1), args.repeats, args.json_lines)
    if args.profile:
        profile(range(20, 23, 2), args.profile)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: parts 3 and 4 (training) are skipped", flush=True)
        return status
    if "train" in parts:
        training(args.train_steps, args.json_lines)
    if "tta" in parts:
        time_to_loss(args.tta_budget, args.json_lines)
    return status


if __name__ == "__main__":
    sys.exit(main())
