"""`python -m gradsum.bench.gpu_check`: what the GPU path must show, in one run of < 10 minutes.

1. The tests: tests/gpu (skipped without CUDA) and the CPU-side tests of the device path (no
   host sync in a THC round, every codec's round on the meta device, the Triton kernels under
   the interpreter, `--device`).
2. The benchmark: THC and bfp encode + decode of one worker's gradient of 2**20 .. 2**26
   coordinates against a device copy of the same gradient, timed with CUDA events, THC with
   the fused Triton kernels (with its error feedback, as training runs it, and without) and
   on the torch path. Each row is printed (and appended to
   ``--json-lines``) as soon as it is measured. Without CUDA it says so and skips it.

Exit status: the tests' (0 when they pass or skip).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CPU_PARTS = (
    "tests/codecs/test_host_syncs.py",
    "tests/sync/test_device_paths.py",
    "tests/codecs/test_triton.py",
    "tests/train/test_device.py",
    "tests/codecs/test_launches.py",
)
GPU_TESTS = "tests/gpu"


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
            if out is not None:
                with out.open("a") as handle:
                    handle.write(json.dumps(row) + "\n")
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
    parser.add_argument("--no-tests", action="store_true", help="only the benchmark")
    parser.add_argument(
        "--profile", type=int, metavar="ROWS", default=0,
        help="then profile a THC round at 2^20 and 2^22 and print its top ROWS ops",
    )  # fmt: skip
    args = parser.parse_args(argv)
    status = 0 if args.no_tests else run_tests(args.root)
    benchmark(range(20, args.largest + 1), args.repeats, args.json_lines)
    if args.profile:
        profile(range(20, 23, 2), args.profile)
    return status


if __name__ == "__main__":
    sys.exit(main())
