"""`gradsum bench ate --link-rate RATE[,RATE...]`: ATE/s across an emulated cluster's links.

For each link rate, one testbed (``gradsum.testbed``) with n worker hosts, the software switch
(the top-of-rack element, one port per worker) when a switch method is asked for, and one
parameter-server host (one NIC shared by all workers) when a server method is. In it, side by
side: Gloo all-reduce and gradsum's switch and server with codecs. The testbed is removed
afterwards, also on an error, Ctrl-C or SIGTERM.

Each row also says where the method's time goes: the codec's CPU time for this size on one worker
(measured once, alone, on a testbed host) and the time its bytes need on the bottleneck link at
the configured rate. Pure parts (wire model, rows, table, plot data) are separate from the shell.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..dataplane.packet import HEADER_SIZE
from .ate import METHODS, multicast

TESTBED_METHODS = ("gloo", "switch+bfp", "switch+thc", "server+thc", "server+topk")
DEFAULT_ELEMENTS = 1 << 22
MAX_SLOTS = 32
DATAGRAM_BYTES = 1 << 16  # one window unit: a 64 KiB datagram, or a GSO chunk of that size
# Kernel memory one window unit holds in a socket buffer. With --fragmented, a reassembled 64 KiB
# datagram: 45 fragment buffers of 1500-byte frames took 102.6 kB (`ss -m`), 8 jumbo fragments
# (the testbed's MTU 9000) about 8 x 16 KiB. By default a unit is 7 packets of one 9000-byte frame
# each, about 7 x 16 KiB if each frame takes a 16 KiB buffer (not re-measured): the same bound
# holds. Windows are sized for half the aggregator's buffer: retransmitted duplicates need room
# too (UdpRcvbufErrors at the switch with 4 workers x 19 slots in a 8 MiB buffer).
DATAGRAM_TRUESIZE = 128 << 10
BUFFER_HEADROOM = 2
HEADER_BYTES = HEADER_SIZE  # gradsum's packet header (docs/protocol.md)
PS_HOST = "ps0"
SWITCH_HOST = "switch"


@dataclass(frozen=True)
class Setup:
    """What one invocation measures at every rate."""

    workers: int
    sizes: tuple[int, ...]
    methods: tuple[str, ...]
    steps: int
    warmup: int
    slots: int | None  # None: default_slots for each rate
    testbed_id: str = "ate"
    receive_buffer: int = 64 << 20  # the aggregator's socket receive buffer (bytes)
    pipelines: int = 1  # processes of the switch/server daemon
    unicast_results: bool = False  # the switch sends n copies instead of one multicast
    fragmented: bool = False  # 64 KiB datagrams that IP fragments, not MTU-sized packets (GSO)
    drop_rate: float = 0.0  # loss the switch/server injects in each direction (not Gloo's)

    def slots_at(self, rate: int, method: str | None = None) -> int:
        shared = method is not None and METHODS[method][0] == "server"
        return self.slots or default_slots(rate, self.workers, self.receive_buffer, shared=shared)


# --- pure: rates, wire model, rows, table -----------------------------------------------------


def parse_rates(text: str) -> list[int]:
    """``"100mbit,1gbit"`` -> bit/s, in the order given; ValueError names the bad item."""
    from ..testbed.units import parse_rate

    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ValueError(f"--link-rate {text!r}: empty item; use e.g. 100mbit,1gbit,10gbit")
    rates = [parse_rate(item) for item in items]
    if len(set(rates)) != len(rates):
        raise ValueError(f"--link-rate {text!r}: a rate is listed twice")
    return rates


def topology(methods: Sequence[str]) -> dict:
    """Testbed options the methods need: the switch host, one PS host."""
    kinds = {METHODS[m][0] for m in methods}
    return {"switch": "switch" in kinds, "ps": 1 if "server" in kinds else 0}


def default_slots(
    rate: int, workers: int, receive_buffer: int, queue_s: float = 0.02, shared: bool = False
) -> int:
    """A window that fits both buffers on the path, so no window overflows by itself: a link
    queue (the testbed's ``queue_s`` of line rate plus one burst; a UDP sender is not slowed by
    its qdisc, whatever does not fit is dropped) and the aggregator's socket receive buffer,
    which holds every worker's window when the aggregator lags. A parameter server's one NIC
    (``shared``) queues every worker's window, and its results, in one queue. Between 2 and 32
    slots, or 1 and 32 on a shared link."""
    by_queue = int((rate / 8 * queue_s + DATAGRAM_BYTES) // DATAGRAM_BYTES)
    if shared:
        by_queue //= workers
    by_buffer = receive_buffer // (BUFFER_HEADROOM * workers * DATAGRAM_TRUESIZE)
    return max(1 if shared else 2, min(MAX_SLOTS, by_queue, by_buffer))


def wire_seconds(method: str, profile: dict | None, workers: int, elements: int, rate: int):
    """Seconds the method's bytes need on its busiest link at ``rate`` (payload and gradsum
    headers; IP/UDP/Ethernet framing, 2-4% more, not counted). Gloo: the ring's 2(n-1)/n of the
    tensor each way per link. Switch: each worker's own link, up and down at once. Server: the
    PS host's one NIC carries every worker's bytes."""
    from ..testbed.gloo import ring_wire_seconds

    kind = METHODS[method][0]
    if kind is None:
        return ring_wire_seconds(elements, workers, rate)
    busiest = max(profile["up_bytes"], profile["down_bytes"])
    if kind == "server":
        busiest *= workers
    return busiest * 8 / rate


def step_seconds(per_worker: Sequence[Sequence[float]]) -> float:
    """Median over steps of the slowest worker's time (as on loopback)."""
    return statistics.median(max(step) for step in zip(*per_worker, strict=True))


def make_row(method: str, setup: Setup, elements: int, rate: int, seconds: float,
             profile: dict | None) -> dict:  # fmt: skip
    """One JSON row: the loopback bench's fields, ``link_rate`` and the time breakdown."""
    wire = wire_seconds(method, profile, setup.workers, elements, rate)
    row = {
        "method": method,
        "workers": setup.workers,
        "elements": elements,
        "seconds": seconds,
        "ate_per_s": elements / seconds,
        "drop_rate": setup.drop_rate if METHODS[method][0] else 0.0,
        "steps": setup.steps,
        "link_rate": rate,
        "slots": setup.slots_at(rate, method) if METHODS[method][0] else None,
        "fragmented": setup.fragmented if METHODS[method][0] else None,
        "wire_seconds": wire,
        "codec_cpu_seconds": 0.0,
    }
    if profile is not None:
        row.update(
            codec_cpu_seconds=profile["encode_seconds"] + profile["decode_seconds"],
            encode_seconds=profile["encode_seconds"],
            decode_seconds=profile["decode_seconds"],
            server_cpu_seconds=profile["server_seconds"],
            up_bytes=profile["up_bytes"],
            down_bytes=profile["down_bytes"],
        )
    return row


def format_rate(bits: int) -> str:
    from ..testbed.units import format_rate as tc_rate

    return tc_rate(bits)


def format_table(rows: Sequence[dict]) -> str:
    """Rows with their ratio to Gloo of the same rate and size, and the time breakdown."""
    gloo = {(r["link_rate"], r["elements"]): r["ate_per_s"] for r in rows if r["method"] == "gloo"}
    head = (f"{'rate':>8} {'method':<12} {'elements':>9} {'ms':>8} {'ATE/s':>8} {'vs gloo':>8} "
            f"{'codec ms':>9} {'wire ms':>8} {'wire %':>7}")  # fmt: skip
    lines = [head]
    for r in rows:
        base = gloo.get((r["link_rate"], r["elements"]))
        ratio = f"{r['ate_per_s'] / base:.2f}x" if base else "-"
        codec = f"{1000 * r['codec_cpu_seconds']:.1f}" if r["method"] != "gloo" else "-"
        share = f"{100 * r['wire_seconds'] / r['seconds']:.0f}%"
        lines.append(
            f"{format_rate(r['link_rate']):>8} {r['method']:<12} {r['elements']:>9} "
            f"{1000 * r['seconds']:>8.1f} {r['ate_per_s'] / 1e6:>7.2f}M {ratio:>8} "
            f"{codec:>9} {1000 * r['wire_seconds']:>8.1f} {share:>7}"
        )
    return "\n".join(lines)


def plot_series(rows: Sequence[dict], elements: int) -> dict[str, list[tuple[int, float]]]:
    """method -> [(link rate, ATE/s)] sorted by rate, for one size."""
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["elements"] == elements and r.get("link_rate"):
            series.setdefault(r["method"], []).append((r["link_rate"], r["ate_per_s"]))
    return {m: sorted(points) for m, points in series.items()}


def write_plot(rows: Sequence[dict], path: str) -> None:
    """ATE/s against link rate, log-log, one line per method (the largest size in the rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_rate = [r for r in rows if r.get("link_rate")]
    if not with_rate:
        raise ValueError("no rows with a link_rate to plot")
    elements = max(r["elements"] for r in with_rate)
    workers = {r["workers"] for r in with_rate if r["elements"] == elements}
    figure, axes = plt.subplots(figsize=(6.4, 4.4))
    for method, points in plot_series(with_rate, elements).items():
        rates, ates = zip(*points, strict=True)
        style = "--" if method == "gloo" else "-"
        axes.plot([x / 1e9 for x in rates], ates, style, marker="o", label=method)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("link rate (Gbit/s)")
    axes.set_ylabel("ATE/s (aggregated elements per second)")
    n = ",".join(str(w) for w in sorted(workers))
    axes.set_title(f"{n} workers, {elements} elements, emulated links")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# --- codec profile: runs on a testbed host, alone -----------------------------------------------


def codec_profile(codec_name: str, workers: int, elements: int, repeats: int = 3) -> dict:
    """One worker's codec CPU seconds for a tensor of ``elements`` (median of ``repeats``), the
    parameter server's decode-sum-encode seconds, and the bytes one worker sends and receives."""
    import torch

    from ..codecs.registry import make_codec
    from ..dataplane.codec_wire import wire_format

    torch.set_num_threads(1)
    codec = make_codec(codec_name, workers=workers)
    fmt = wire_format(codec)
    x = torch.randn(elements, generator=torch.Generator().manual_seed(0))
    runs = [_profile_round(codec, fmt, x, workers, step) for step in range(repeats)]
    keys = ("encode_seconds", "decode_seconds", "server_seconds")
    profile = {k: statistics.median(r[k] for r in runs) for k in keys}
    return {**runs[-1], **profile}


class _ProfiledReducer:
    """One worker's real codec round against n - 1 peers that sent the same payload: times
    the codec's own work (encode, decode, and a server's decode-sum-encode, which a switch's
    integer sum is not) and counts the bytes one worker sends and receives, headers included.
    It is a ``codecs.round.Reducer``, so the profile runs the round every aggregator runs."""

    def __init__(self, fmt, workers: int, partition: int):
        from ..dataplane.geometry import chunk_lanes, lanes_fitting

        self.fmt, self.workers = fmt, workers
        bits = max(fmt.in_bits, fmt.out_bits)
        # the client's default: the most lanes a datagram holds, one packet a chunk
        self.per_chunk = chunk_lanes(lanes_fitting(bits), 1, bits) if fmt.lanes else 1
        self.partition = partition
        self.seconds = {"encode_seconds": 0.0, "decode_seconds": 0.0, "server_seconds": 0.0}
        self.up = self.down = 0

    def max(self, summaries):
        self.up += sum(4 * s.numel() for s in summaries) + HEADER_BYTES
        self.down += sum(4 * s.numel() for s in summaries) + HEADER_BYTES
        return list(summaries)  # the max of n equal summaries

    def sum(self, phase) -> None:
        from ..codecs.bits import packed_nbytes
        from ..dataplane import payload_wire

        codec, lanes = phase.codec, self.fmt.lanes
        for i in range(len(phase)):
            t0 = time.perf_counter()
            payload = phase.encode(i)
            blob = None if lanes else payload_wire.serialize(payload)
            t1 = time.perf_counter()
            if lanes:  # the switch's work, not the codec's: not timed
                summed = codec.aggregate([payload] * self.workers, phase.aggregator_context(i))
                t2 = time.perf_counter()
                count = phase.lanes(i)
                headers = -(-count // self.per_chunk) * HEADER_BYTES
                self.up += packed_nbytes(count, self.fmt.in_bits) + headers
                self.down += packed_nbytes(count, self.fmt.out_bits) + headers
            else:
                kept = [payload_wire.deserialize(blob, payload.length, 1)] * self.workers
                data = payload_wire.serialize(codec.aggregate(kept, phase.aggregator_context(i)))
                t2 = time.perf_counter()
                self.seconds["server_seconds"] += t2 - t1
                summed = payload_wire.deserialize(data, payload.length, self.workers)
                self.up, self.down = self.up + len(blob) + HEADER_BYTES, \
                    self.down + len(data) + HEADER_BYTES
            t3 = time.perf_counter()
            phase.deliver(i, summed)
            self.seconds["encode_seconds"] += t1 - t0
            self.seconds["decode_seconds"] += time.perf_counter() - t3


def _profile_round(codec, fmt, x, workers: int, step: int) -> dict:
    """One profiled round (see ``_ProfiledReducer``); the preliminary round counts as encode.
    Decode-sum-encode codecs run in partitions of the UDP client's default (one per packet)."""
    from ..codecs.round import PARTITION_ELEMENTS, CodecRound

    partition = PARTITION_ELEMENTS if fmt.lanes else 1 << 13
    reducer = _ProfiledReducer(fmt, workers, partition)
    round_ = CodecRound(codec, 0, partition)
    start = time.perf_counter()
    prepared = round_.prepare(x, worker=0, key=None, step=step)
    if codec.needs_summary:
        prepared.share(reducer.max(prepared.summaries))
    reducer.seconds["encode_seconds"] += time.perf_counter() - start
    phase = prepared.sum_phase()
    reducer.sum(phase)
    phase.check_complete()
    return {**reducer.seconds, "up_bytes": reducer.up, "down_bytes": reducer.down}


# --- shell: testbeds, daemons, workers ----------------------------------------------------------


def measure_rate(setup: Setup, rate: int, profiles: dict, progress=print) -> list[dict]:
    """All methods and sizes at one link rate, in one testbed; ``profiles`` (codec, elements) ->
    codec profile is filled on first use."""
    from ..testbed import Testbed

    rows = []
    options = topology(setup.methods)
    with Testbed(setup.workers, rate=rate, id=setup.testbed_id, **options) as tb:
        for elements in setup.sizes:
            for method in setup.methods:
                codec = METHODS[method][1]
                if codec and (codec, elements) not in profiles:
                    progress(f"  codec profile of {codec}, {elements} elements, on w0 ...")
                    profiles[codec, elements] = tb.call(
                        tb.workers[0], codec_profile, args=(codec, setup.workers, elements),
                        timeout=600,
                    )  # fmt: skip
                progress(f"  {format_rate(rate)}: {method}, {elements} elements ...")
                seconds, counters = measure_method(tb, method, elements, setup, rate)
                profile = profiles.get((codec, elements))
                row = make_row(method, setup, elements, rate, seconds, profile)
                rows.append({**row, **counters})
    return rows


def measure_method(tb, method: str, elements: int, setup: Setup, rate: int):
    """Seconds of one allreduce of ``method`` across ``tb`` (median of the slowest worker) and
    the gradsum workers' packet counters summed (sent, retransmitted; none for Gloo)."""
    from ..net.loopback import WorkerTask
    from ..testbed.aggregation import NamespaceDaemon, aggregate
    from ..testbed.gloo import gloo_allreduce
    from ..testbed.plan import MTU

    kind, codec = METHODS[method]
    if kind is None:
        result = gloo_allreduce(tb, elements, iterations=setup.steps, warmup=setup.warmup,
                                timeout=600)  # fmt: skip
        return result.median_seconds, {}
    host = SWITCH_HOST if kind == "switch" else PS_HOST
    task = WorkerTask((), job=1, workers=setup.workers, codec=codec, elements=elements,
                      steps=setup.warmup + setup.steps, slots=setup.slots_at(rate, method),
                      keep_output=False, multicast=multicast(kind, setup),
                      mtu=None if setup.fragmented else MTU)  # fmt: skip
    flags = ("--drop-rate", str(setup.drop_rate)) if setup.drop_rate else ()
    with NamespaceDaemon(tb, host, kind, *flags, pipelines=setup.pipelines) as daemon:
        results = aggregate(tb, daemon, task, timeout=600)
    # the testbed's workers time every step; the first `warmup` ones (job start-up) are dropped
    seconds = step_seconds([r.seconds[setup.warmup :] for r in results])
    counters = packet_counters(r.stats for r in results)
    return seconds, {**counters, "injected_drops": injected_drops(daemon.stderr or "")}


def packet_counters(worker_stats) -> dict:
    """Packets sent and retransmitted by all workers over all steps (warm-up included)."""
    totals = {"packets_sent": 0, "retransmissions": 0}
    for stats in worker_stats:
        for job in stats.values():
            for key in totals:
                totals[key] += job.get(key, 0)
    return totals


def injected_drops(daemon_stderr: str) -> int:
    """Packets the daemon's loss injection dropped, both ways, all pipelines: from the final
    statistics each pipeline prints on exit (``...: stopped; statistics {json}``)."""
    total = 0
    for line in daemon_stderr.splitlines():
        _, found, stats = line.partition(": stopped; statistics ")
        if found:
            daemon = json.loads(stats).get("daemon", {})
            total += daemon.get("injected_dropped_in", 0) + daemon.get("injected_dropped_out", 0)
    return total


def run(args) -> int:
    """The CLI: measure at every ``--link-rate`` (or only plot ``--from-json`` rows)."""
    from ..cli import UsageError

    if args.from_json:
        return _plot_only(args)
    try:
        rates = parse_rates(args.link_rate)
    except ValueError as error:
        raise UsageError(str(error)) from None
    setup = Setup(args.workers, tuple(args.sizes or [DEFAULT_ELEMENTS]),
                  tuple(args.methods or TESTBED_METHODS), args.steps, args.warmup,
                  args.slots, args.testbed_id, receive_buffer(), args.pipelines,
                  args.unicast_results, args.fragmented, args.drop_rate)  # fmt: skip
    rows: list[dict] = []
    profiles: dict = {}
    for rate in rates:
        print(f"testbed at {format_rate(rate)}: {setup.workers} workers, "
              f"{', '.join(setup.methods)}; window {setup.slots_at(rate)} slots "
              f"({setup.slots_at(rate, 'server+thc')} through a server's one NIC)"
              f"{loss_note(setup.drop_rate)}", flush=True)  # fmt: skip
        rows += measure_rate(setup, rate, profiles, progress=_progress)
    print(format_table(rows))
    _write(rows, args)
    return 0


def loss_note(drop_rate: float) -> str:
    if not drop_rate:
        return ""
    return f"; the switch/server drops {drop_rate:.2%} of packets each way (Gloo runs loss-free)"


def receive_buffer() -> int:
    """What the daemons' sockets get as their receive buffer (root may exceed
    ``net.core.rmem_max``; the kernel doubles the request for bookkeeping)."""
    from ..net.udp import granted_receive_buffer

    return granted_receive_buffer()


def _progress(text: str) -> None:
    print(text, flush=True)


def _write(rows: list[dict], args) -> None:
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
        print(f"rows written to {args.json}")
    rates = {r["link_rate"] for r in rows}
    if args.plot or len(rates) > 1:
        path = args.plot or "ate-link-rate.png"
        write_plot(rows, path)
        print(f"plot written to {path}")


def _plot_only(args) -> int:
    from ..cli import UsageError

    if not args.plot:
        raise UsageError("--from-json needs --plot PATH (the PNG to write)")
    rows = []
    for path in args.from_json:
        try:
            with open(path) as source:
                rows += json.load(source)
        except (OSError, ValueError) as error:
            raise UsageError(f"--from-json {path}: {error}") from None
    if not any(r.get("link_rate") for r in rows):
        raise UsageError("--from-json: no rows with a link_rate (run with --link-rate)")
    print(format_table([r for r in rows if r.get("link_rate")]))
    write_plot(rows, args.plot)
    print(f"plot written to {args.plot}")
    return 0


def default_testbed_id() -> str:
    """Unique per process, so two benchmarks never share (or remove) each other's testbed."""
    return f"ate{os.getpid() % 100000}"
