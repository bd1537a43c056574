"""`gradsum bench ps-core`: what one PS core costs per message and per byte, through Gloo
send/recv, against the number of workers sending to it.

The PS of a PyTorch prototype (the IMerge seed's: PyTorch 1.8, one CPU core per PS) receives
each worker's gradient with ``recv``, sums, and answers each worker with ``send``. This bench
plays that on this host: one PS process pinned to one core, and ``k`` senders (threads of one
process pinned to the other cores, each with its own Gloo pair to the PS, as every rank of a
world group has). A round: every sender sends ``size`` fp32 elements and waits for the sum; the
PS receives all k, adds each into the sum as it comes in, and sends the sum back to all k.
Warm-up rounds first, then ``--rounds`` timed ones per size, for every k of ``--senders``.

Per (k, size) it records the median round's wall time and the CPU seconds per round of the PS
process and of the senders' process (all their threads: Gloo's I/O included). On a shared host
wall time carries other processes' load; CPU time is the work itself. A round moves 2k messages
and 2k·size·4 bytes through the PS core, so per k the least-squares line of the PS's CPU per
round over the bytes gives its cost per message α (intercept / 2k) and its rate (2k / slope):
what ``imerge-prototype``'s shards take, at 32 senders (the seed's 32 workers). The senders'
CPU per message (intercept / 2k of their line) is a worker's α.

    gradsum bench ps-core --senders 1,2,4,8,16,32 --sizes 256,16384,262144 --json core.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np

from ..config import positive_int
from .cli import parse_list

DEFAULT_SENDERS = (1, 2, 4, 8, 16, 32)
DEFAULT_SIZES = (256, 16_384, 262_144)  # fp32 elements: 1 KiB, 64 KiB, 1 MiB
ELEMENT_BYTES = 4
JOIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class CoreRow:
    """One (senders, size) cell: the median round and each side's CPU per round."""

    senders: int
    elements: int
    rounds: int
    wall_s: float  # median round, wall clock, as the PS times it
    wall_spread: float  # the rounds' interquartile range over their median
    ps_cpu_s: float  # the PS process's CPU seconds per round
    sender_cpu_s: float  # the senders' process's CPU seconds per round (all k together)

    @property
    def bytes(self) -> int:
        return self.elements * ELEMENT_BYTES


@dataclass(frozen=True)
class CoreFit:
    """Per sender count: the PS core's and a worker's cost per message, the PS core's rate."""

    senders: int
    ps_alpha_s: float  # PS CPU per message (a push received or an answer sent)
    ps_rate: float  # bytes per second of PS CPU (received and summed, or sent)
    worker_alpha_s: float  # a sender's CPU per message
    wall_alpha_s: float  # the same line over the median wall-clock round
    wall_rate: float

    def row(self) -> dict:
        return asdict(self)


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares intercept and slope (a flat line where only one size was timed)."""
    if np.unique(x).size < 2:
        return float(np.median(y)), 0.0
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def fit_core(rows: list[CoreRow]) -> list[CoreFit]:
    """Per sender count k, the lines of CPU and wall time per round over a message's bytes.

    A round is 2k messages at the PS (k pushes, k answers) of ``bytes`` each, so with a
    per-message cost α and a rate B its time is 2k·(α + bytes/B): α = intercept / 2k,
    B = 2k / slope. An intercept below 0 is clipped to 0; a slope at or below 0 (time not
    growing with size) gives an infinite rate. The senders' process runs k senders, each one
    push and one answer per round: its α is its intercept / 2k."""
    fits = []
    for k in sorted({r.senders for r in rows}):
        cells = [r for r in rows if r.senders == k]
        x = np.array([r.bytes for r in cells], dtype=float)
        per = 2 * k
        ps_a, ps_b = _line(x, np.array([r.ps_cpu_s for r in cells]))
        w_a, _ = _line(x, np.array([r.sender_cpu_s for r in cells]))
        wall_a, wall_b = _line(x, np.array([r.wall_s for r in cells]))
        fits.append(
            CoreFit(
                senders=k,
                ps_alpha_s=max(0.0, ps_a) / per,
                ps_rate=per / ps_b if ps_b > 0 else float("inf"),
                worker_alpha_s=max(0.0, w_a) / per,
                wall_alpha_s=max(0.0, wall_a) / per,
                wall_rate=per / wall_b if wall_b > 0 else float("inf"),
            )
        )
    return fits


# ----------------------------------------------------------------- the two processes
def _pin(cores: list[int]) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, set(cores))


def _store(port: int, master: bool, timeout: timedelta):
    import torch.distributed as dist

    if master:
        return dist.TCPStore("127.0.0.1", port, None, True, timeout, wait_for_workers=False)
    return dist.TCPStore("127.0.0.1", port, None, False, timeout)


def _pairs(store, senders: int, rank: int, timeout: timedelta) -> list:
    """One Gloo pair per sender (the PS rank 0, the sender rank 1), made in the same order on
    both sides: a store client is not shared between threads while they connect."""
    import torch.distributed as dist

    return [
        dist.ProcessGroupGloo(dist.PrefixStore(f"pair{i}", store), rank, 2, timeout)
        for i in range(senders)
    ]


def _ps_main(port, senders, sizes, warmup, rounds, core, timeout_s, results) -> None:
    import torch

    _pin([core])
    torch.set_num_threads(1)
    timeout = timedelta(seconds=timeout_s)
    store = _store(port, True, timeout)
    pairs = _pairs(store, senders, 0, timeout)
    out = []
    for elements in sizes:
        inbox = [torch.zeros(elements) for _ in range(senders)]
        total = torch.zeros(elements)
        walls = []
        cpu_start = 0.0
        for r in range(warmup + rounds):
            if r == warmup:
                cpu_start = time.process_time()
            start = time.perf_counter()
            works = [pair.recv([buf], 1, 0) for pair, buf in zip(pairs, inbox, strict=True)]
            total.zero_()
            for work, buf in zip(works, inbox, strict=True):
                work.wait(timeout)
                total.add_(buf)
            for work in [pair.send([total], 1, 1) for pair in pairs]:
                work.wait(timeout)
            walls.append(time.perf_counter() - start)
        cpu = (time.process_time() - cpu_start) / rounds
        timed = walls[warmup:]
        q1, _, q3 = statistics.quantiles(timed, n=4) if len(timed) > 1 else (0, 0, 0)
        median = statistics.median(timed)
        out.append((elements, median, (q3 - q1) / median, cpu))
    results.put(("ps", out))


def _send_rounds(pair, elements, warmup, rounds, gate, errors, timeout) -> None:
    """One sender: a push and the wait for its answer per round, the timed rounds after
    ``gate`` (every sender and the main thread)."""
    import torch

    try:
        grad, answer = torch.ones(elements), torch.zeros(elements)
        for r in range(warmup + rounds):
            if r == warmup:
                gate.wait()
            pair.send([grad], 0, 0).wait(timeout)
            pair.recv([answer], 0, 1).wait(timeout)
    except BaseException as error:  # reported by the main thread
        errors.append(error)
        gate.abort()


def _senders_main(port, senders, sizes, warmup, rounds, cores, timeout_s, results) -> None:
    import threading

    import torch

    _pin(cores)
    torch.set_num_threads(1)
    timeout = timedelta(seconds=timeout_s)
    store = _store(port, False, timeout)
    pairs = _pairs(store, senders, 1, timeout)
    out = []
    for elements in sizes:
        gate = threading.Barrier(senders + 1, timeout=timeout_s)
        errors: list[BaseException] = []

        threads = [
            threading.Thread(
                target=_send_rounds,
                args=(pair, elements, warmup, rounds, gate, errors, timeout),
                daemon=True,
            )
            for pair in pairs
        ]
        for thread in threads:
            thread.start()
        gate.wait()
        cpu_start = time.process_time()
        for thread in threads:
            thread.join(timeout_s)
        if errors or any(t.is_alive() for t in threads):
            raise RuntimeError(f"a sender failed or timed out after {timeout_s} s: {errors[:1]}")
        out.append((elements, (time.process_time() - cpu_start) / rounds))
    results.put(("senders", out))


def measure(
    senders: int,
    sizes: list[int],
    *,
    rounds: int = 20,
    warmup: int = 3,
    port: int = 29_731,
    ps_core: int = 0,
    timeout_s: float = 120.0,
) -> list[CoreRow]:
    """Every size's :class:`CoreRow` for ``senders`` senders: two fresh processes, the PS on
    core ``ps_core`` and the senders on every other core this process may use (all of them on
    a one-core host)."""
    import multiprocessing

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    if ps_core not in cores:
        raise ValueError(f"--ps-core {ps_core} is not a core this process may use ({cores})")
    others = [c for c in cores if c != ps_core] or [ps_core]
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    ps = spawn.Process(
        target=_ps_main, args=(port, senders, sizes, warmup, rounds, ps_core, timeout_s, results)
    )
    ps.start()
    sending = spawn.Process(
        target=_senders_main,
        args=(port, senders, sizes, warmup, rounds, others, timeout_s, results),
    )
    sending.start()
    got: dict[str, list] = {}
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while len(got) < 2:
            left = deadline - time.monotonic()
            if left <= 0 or (not (ps.is_alive() or sending.is_alive()) and results.empty()):
                raise RuntimeError(
                    f"ps-core: no result from the {'PS' if 'ps' not in got else 'senders'} "
                    f"process for {senders} senders within {JOIN_TIMEOUT_S:.0f} s (exit codes "
                    f"{ps.exitcode}, {sending.exitcode})"
                )
            try:
                side, data = results.get(timeout=min(left, 5.0))
            except Exception:  # queue.Empty: check the processes again
                continue
            got[side] = data
    finally:
        for process in (ps, sending):
            process.join(10)
            if process.is_alive():
                process.terminate()
                process.join(10)
    sender_cpu = dict(got["senders"])
    return [
        CoreRow(senders, elements, rounds, wall, spread, cpu, sender_cpu[elements])
        for elements, wall, spread, cpu in got["ps"]
    ]


# ----------------------------------------------------------------- the command
def register(benches: argparse._SubParsersAction) -> None:
    parser = benches.add_parser(
        "ps-core",
        help="a PS core's cost per message and per byte through Gloo send/recv, against the "
        "number of senders",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--senders",
        default=",".join(map(str, DEFAULT_SENDERS)),
        help="comma-separated numbers of senders (default %(default)s)",
    )
    parser.add_argument(
        "--sizes",
        default=",".join(map(str, DEFAULT_SIZES)),
        help="comma-separated fp32 elements per message (default %(default)s)",
    )
    parser.add_argument("--rounds", type=positive_int, default=20, help="timed rounds per size")
    parser.add_argument("--warmup", type=positive_int, default=3, help="untimed rounds first")
    parser.add_argument("--repeats", type=positive_int, default=1, help="the whole sweep again")
    parser.add_argument("--ps-core", type=int, default=0, help="the core the PS is pinned to")
    parser.add_argument("--port", type=positive_int, default=29_731, help="the store's port")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds any one transfer may take"
    )
    parser.add_argument("--json", metavar="PATH", help="write every row and fit")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..cli import UsageError

    senders = parse_list(args.senders, int, "senders")
    sizes = parse_list(args.sizes, int, "sizes")
    if min(senders) < 1 or min(sizes) < 1:
        raise UsageError("--senders and --sizes: positive integers")
    if args.timeout <= 0:
        raise UsageError(f"--timeout: expected a positive number of seconds, got {args.timeout}")
    repeats = []
    for repeat in range(args.repeats):
        rows = []
        for k in senders:
            started = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            rows += measure(
                k,
                sizes,
                rounds=args.rounds,
                warmup=args.warmup,
                port=args.port,
                ps_core=args.ps_core,
                timeout_s=args.timeout,
            )
            print(f"repeat {repeat + 1}, {k} senders done (load average {started:.1f} at start)")
        fits = fit_core(rows)
        repeats.append({"rows": [asdict(r) for r in rows], "fits": [f.row() for f in fits]})
        print(format_rows(rows, fits))
    if args.repeats > 1:
        print(format_spread([[CoreFit(**f) for f in r["fits"]] for r in repeats]))
    if args.json:
        Path(args.json).write_text(json.dumps({"repeats": repeats}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


def format_rows(rows: list[CoreRow], fits: list[CoreFit]) -> str:
    lines = [
        f"{'senders':>8}{'elements':>10}{'wall ms':>10}{'IQR/med':>9}{'PS cpu ms':>11}"
        f"{'snd cpu ms':>11}"
    ]
    for r in rows:
        lines.append(
            f"{r.senders:>8}{r.elements:>10}{r.wall_s * 1e3:>10.3f}{r.wall_spread:>9.2f}"
            f"{r.ps_cpu_s * 1e3:>11.3f}{r.sender_cpu_s * 1e3:>11.3f}"
        )
    lines.append(
        f"\n{'senders':>8}{'PS α µs':>10}{'PS GB/s':>10}{'worker α µs':>13}"
        f"{'wall α µs':>11}{'wall GB/s':>11}   (per message; a round is 2k messages)"
    )
    for f in fits:
        lines.append(
            f"{f.senders:>8}{f.ps_alpha_s * 1e6:>10.1f}{f.ps_rate / 1e9:>10.2f}"
            f"{f.worker_alpha_s * 1e6:>13.1f}{f.wall_alpha_s * 1e6:>11.1f}"
            f"{f.wall_rate / 1e9:>11.2f}"
        )
    return "\n".join(lines)


def format_spread(repeats: list[list[CoreFit]]) -> str:
    """Each sender count's fitted values over the repeats: median [min, max]."""
    lines = ["\nover the repeats: median [min–max]"]
    lines.append(f"{'senders':>8}{'PS α µs':>24}{'PS GB/s':>22}{'worker α µs':>24}")
    by_k: dict[int, list[CoreFit]] = {}
    for fits in repeats:
        for f in fits:
            by_k.setdefault(f.senders, []).append(f)

    def cell(values: list[float], scale: float, digits: int) -> str:
        v = [x * scale for x in values]
        return f"{statistics.median(v):.{digits}f} [{min(v):.{digits}f}–{max(v):.{digits}f}]"

    for k, fits in sorted(by_k.items()):
        lines.append(
            f"{k:>8}{cell([f.ps_alpha_s for f in fits], 1e6, 1):>24}"
            f"{cell([f.ps_rate for f in fits], 1e-9, 2):>22}"
            f"{cell([f.worker_alpha_s for f in fits], 1e6, 1):>24}"
        )
    return "\n".join(lines)
