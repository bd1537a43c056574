"""`gradsum bench ate`: aggregated tensor elements per second (SwitchML's metric) on loopback.

For every size, in the same run: Gloo ``all_reduce`` (torch.distributed) and gradsum's switch and
parameter server with codecs, each with n worker processes. ATE/s = elements / seconds of one
allreduce, taking per step the slowest worker (the step is done when every worker has the
average) and the median over steps. Ratios are to Gloo of the same size.

On loopback every process shares this machine's cores, so the run is CPU-bound and a method's
speed is mostly the CPU it spends: the table also gives CPU milliseconds per allreduce, all
processes together (workers over the timed steps; a switch or server over the whole run, warmup
included, divided by its steps), a far steadier figure than time on a shared, noisy machine.
``--rounds N`` measures every method N times, in alternating order (drift on the machine then
falls on every method alike), and reports medians over the rounds and the range of the per-round
ratios to Gloo.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

from .. import processes
from ..failures import Failure, WorkerFailed

METHODS = {  # name -> (aggregator kind, codec); "gloo" is torch.distributed
    "gloo": (None, None),
    "switch+bfp": ("switch", "bfp"),
    "switch+thc": ("switch", "thc"),
    "server+none": ("server", "none"),
    "server+thc": ("server", "thc"),
    "server+topk": ("server", "topk"),
}


def register(benches: argparse._SubParsersAction) -> None:
    from ..config import positive_int
    from .cli import parse_size

    parser = benches.add_parser(
        "ate",
        help="ATE/s of Gloo vs gradsum switch/server with codecs, n workers on loopback",
        description="Aggregated tensor elements per second for Gloo all_reduce and gradsum's "
        "switch and server with codecs, n worker processes on this machine, side by side.",
    )
    parser.add_argument("--workers", type=positive_int, default=4)
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=None,
                        help="elements per tensor (default 2^20 2^22, with --link-rate 2^22; "
                        "up to 2^24)")  # fmt: skip
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                        help="default all; with --link-rate gloo switch+bfp switch+thc "
                        "server+thc server+topk")  # fmt: skip
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per method")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="rounds of every method, in alternating order; medians over the "
                        "rounds (default 1)")  # fmt: skip
    parser.add_argument("--drop-rate", type=float, default=0.0,
                        help="loss injected at the switch/server in each direction")  # fmt: skip
    parser.add_argument("--slots", type=positive_int, default=None,
                        help="window (slots per job; default 32)")  # fmt: skip
    parser.add_argument("--pipelines", type=positive_int, default=1,
                        help="processes of the switch/server (gradsum switch --pipelines): a "
                        "job's lanes are spread over them (default 1)")  # fmt: skip
    parser.add_argument("--mtu", type=int, default=None,
                        help="packets that fit this path MTU, a chunk of them per GSO send, as "
                        "`gradsum train --mtu` (default: datagrams of up to 64 KiB; loopback "
                        "never fragments them)")  # fmt: skip
    parser.add_argument("--unicast-results", action="store_true",
                        help="the switch sends each worker its own copy of every result "
                        "(default: one multicast, replicated by the network)")  # fmt: skip
    parser.add_argument("--integrity", nargs="+", default=["token"], choices=INTEGRITY,
                        help="data-plane integrity of gradsum's jobs: token (a keyed job, "
                        "every packet carries its data token; the default), mac (also a keyed "
                        "BLAKE2b tag on every packet, checked in Python on both sides) or none "
                        "(a job without a key, protocol 1's trust); several: each method with "
                        "each, side by side (rows METHOD/MODE)")  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="write one row per measurement")
    testbed = parser.add_argument_group(
        "across an emulated cluster (gradsum testbed; needs root and iproute2)"
    )
    testbed.add_argument("--link-rate", metavar="RATE[,RATE...]",
                         help="run in a testbed with links of this rate (100mbit, 1gbit, 10gbit; "
                         "a comma list runs each), built and removed by the command")  # fmt: skip
    testbed.add_argument(
        "--fragmented",
        action="store_true",
        help="gradsum packets of up to 64 KiB, which IP cuts into fragments "
        "(default: packets of one frame, a chunk of them per GSO send)",
    )
    testbed.add_argument("--plot", metavar="PATH", help="PNG of ATE/s against link rate "
                         "(default ate-link-rate.png when several rates run)")  # fmt: skip
    testbed.add_argument(
        "--from-json",
        metavar="PATH",
        nargs="+",
        help="only plot rows of earlier --link-rate runs (with --plot)",
    )
    testbed.add_argument(
        "--testbed-id",
        default=None,
        help="testbed id (default ate<pid>; an existing one is replaced)",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..cli import UsageError

    if not 0.0 <= args.drop_rate < 1.0:
        raise UsageError(f"--drop-rate must be in [0, 1), got {args.drop_rate}")
    if args.sizes and max(args.sizes) > 1 << 24:
        raise UsageError("--sizes: at most 2^24 elements")
    if args.mtu is not None:
        from ..dataplane.geometry import MAX_MTU, MIN_MTU

        if args.link_rate or args.from_json:
            raise UsageError("--mtu is for loopback runs; a testbed sends MTU-sized packets")
        if not MIN_MTU <= args.mtu <= MAX_MTU:
            raise UsageError(f"--mtu {args.mtu}: must be between {MIN_MTU} and {MAX_MTU}")
    if args.link_rate or args.from_json:
        from . import ate_testbed

        if args.rounds != 1:
            raise UsageError("--rounds is for loopback runs; a testbed run measures once")

        args.testbed_id = args.testbed_id or ate_testbed.default_testbed_id()
        return ate_testbed.run(args)
    if args.plot:
        raise UsageError("--plot needs --link-rate or --from-json")
    if args.fragmented:
        raise UsageError("--fragmented is about a testbed's frames: it needs --link-rate")
    args.sizes = args.sizes or [1 << 20, 1 << 22]
    args.methods = args.methods or list(METHODS)
    args.slots = args.slots or 32
    runs = _runs(args.methods, args.integrity)
    rows = []
    for elements in args.sizes:
        rounds: dict[str, list[Measurement]] = {label: [] for label, _, _ in runs}
        for index in range(args.rounds):
            order = runs if index % 2 == 0 else runs[::-1]
            for label, method, mode in order:
                of = f" (round {index + 1} of {args.rounds})" if args.rounds > 1 else ""
                print(f"measuring {label} with {args.workers} workers, {elements} elements"
                      f"{of} ...", flush=True)  # fmt: skip
                rounds[label].append(measure(method, args.workers, elements, args, mode))
        rows += [_row(label, args, elements, rounds[label]) for label, _, _ in runs]
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0


@dataclass(frozen=True)
class Measurement:
    seconds: float  # one allreduce: median over steps of the slowest worker
    cpu_seconds: float | None  # CPU of all processes per allreduce (None: not measurable)


INTEGRITY = ("token", "mac", "none")


def _runs(methods: list[str], modes: list[str]) -> list[tuple[str, str, str]]:
    """(row label, method, integrity) of each measurement: gloo once, the others per mode."""
    runs = []
    for method in methods:
        for mode in (modes[:1] if METHODS[method][0] is None else modes):
            several = len(modes) > 1 and METHODS[method][0] is not None
            runs.append((f"{method}/{mode}" if several else method, method, mode))
    return runs


def measure(method: str, workers: int, elements: int, args, integrity: str = "token"):
    kind, codec = METHODS[method]
    if kind is None:
        per_worker, cpu = _gloo(workers, elements, args.steps, args.warmup)
    else:
        per_worker, cpu = _gradsum(kind, codec, workers, elements, args, integrity)
    seconds = statistics.median(max(step) for step in zip(*per_worker, strict=True))
    return Measurement(seconds, cpu)


def _gradsum(
    kind: str, codec: str, workers: int, elements: int, args, integrity: str = "token"
) -> tuple[list[list[float]], float | None]:
    """Per worker its step seconds, and the CPU seconds of all processes per allreduce."""
    from ..dataplane.authentication import new_key
    from ..net.loopback import DaemonProcess, WorkerTask, run_workers

    flags = ("--drop-rate", str(args.drop_rate)) if args.drop_rate else ()
    flags += ("--pipelines", str(args.pipelines))
    with DaemonProcess(kind, *flags) as daemon:
        task = WorkerTask(daemon.addresses, job=1, workers=workers, codec=codec,
                          elements=elements, steps=args.steps, warmup=args.warmup,
                          slots=args.slots, keep_output=False,
                          multicast=multicast(kind, args), mtu=args.mtu,
                          key=None if integrity == "none" else new_key(),
                          integrity="mac" if integrity == "mac" else "token")  # fmt: skip
        before = daemon.cpu_seconds()
        results = run_workers(task, timeout=600)
        after = daemon.cpu_seconds()
    cpu = None
    if before is not None and after is not None:
        cpu = (after - before) / (args.steps + args.warmup)
        cpu += sum(r.cpu_seconds for r in results) / args.steps
    return [r.seconds for r in results], cpu


def multicast(kind: str, args) -> bool:
    """Switches multicast results (the network replicates them, as a hardware switch's
    multicast engine does); servers answer each worker, as the PS model has them."""
    return kind == "switch" and not args.unicast_results


def _gloo(workers: int, elements: int, steps: int, warmup: int) -> tuple[list[list[float]], float]:
    import torch.distributed as dist

    # the workers meet through a store held here, on a port the kernel chose (a port found
    # free and released could be taken before worker 0 bound it)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    context = processes.context()
    queue = context.Queue()
    started = [
        processes.process(context, _gloo_worker, (r, workers, port, elements, steps, warmup, queue))
        for r in range(workers)
    ]
    for process in started:
        processes.start(process)
    try:
        results = [queue.get(timeout=600) for _ in started]
    finally:
        for process in started:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    failures = [r for r in results if isinstance(r, Failure)]
    if failures:  # the first to arrive: the others are likely its peers, cut off
        raise WorkerFailed(failures[0])
    results.sort()
    cpu = sum(cpu for _, _, cpu in results) / steps
    return [seconds for _, seconds, _ in results], cpu


def _gloo_worker(rank, workers, port, elements, steps, warmup, queue) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=workers)
        tensor = torch.randn(elements, generator=torch.Generator().manual_seed(rank))
        for _ in range(warmup):
            dist.all_reduce(tensor.clone())
        seconds, cpu = [], 0.0
        for _ in range(steps):
            work = tensor.clone()
            start, start_cpu = time.perf_counter(), time.process_time()
            dist.all_reduce(work)
            work /= workers  # the average, as gradsum returns
            seconds.append(time.perf_counter() - start)
            cpu += time.process_time() - start_cpu
        dist.destroy_process_group()
        queue.put((rank, seconds, cpu))
    except BaseException as error:  # reported by the parent
        queue.put(Failure.of(error, rank))


def _row(method: str, args, elements: int, rounds: list[Measurement]) -> dict:
    seconds = statistics.median(m.seconds for m in rounds)
    cpu = [m.cpu_seconds for m in rounds if m.cpu_seconds is not None]
    return {
        "method": method,
        "workers": args.workers,
        "elements": elements,
        "seconds": seconds,
        "ate_per_s": elements / seconds,
        "cpu_ms": 1000 * statistics.median(cpu) if cpu else None,
        "drop_rate": args.drop_rate if method != "gloo" else 0.0,
        "steps": args.steps,
        "pipelines": args.pipelines if method != "gloo" else 0,
        "mtu": args.mtu if method != "gloo" else None,
        "round_seconds": [m.seconds for m in rounds],
    }


def format_table(rows: list[dict]) -> str:
    gloo = {r["elements"]: r for r in rows if r["method"] == "gloo"}
    repeated = any(len(r.get("round_seconds", ())) > 1 for r in rows)
    header = (f"{'method':<18} {'workers':>7} {'elements':>10} {'ms':>9} {'ATE/s':>10} "
              f"{'vs gloo':>8} {'CPU ms':>8}")  # fmt: skip
    lines = [header + (f" {'rounds vs gloo':>15}" if repeated else "")]
    for r in rows:
        base = gloo.get(r["elements"])
        ratio = f"{r['ate_per_s'] / base['ate_per_s']:.2f}x" if base else "-"
        cpu = f"{r['cpu_ms']:.1f}" if r.get("cpu_ms") is not None else "-"
        line = (f"{r['method']:<18} {r['workers']:>7} {r['elements']:>10} "
                f"{1000 * r['seconds']:>9.1f} {r['ate_per_s'] / 1e6:>9.1f}M {ratio:>8} "
                f"{cpu:>8}")  # fmt: skip
        if repeated:
            line += f" {_round_ratios(r, base):>15}"
        lines.append(line)
    return "\n".join(lines)


def _round_ratios(row: dict, gloo: dict | None) -> str:
    """The lowest and highest of the per-round ratios to Gloo (rounds pair up in time)."""
    if gloo is None or "round_seconds" not in row:
        return "-"
    ratios = [g / s for g, s in zip(gloo["round_seconds"], row["round_seconds"], strict=False)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"
