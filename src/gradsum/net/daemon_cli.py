"""What `gradsum switch` and `gradsum server` share: flags, startup, signals, statistics."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time

MIB = 1 << 20
MAX_JOBS = 1024  # jobs of all admission secrets together


def add_daemon_arguments(parser: argparse.ArgumentParser, job_memory_mib: int) -> None:
    parser.add_argument(
        "--bind",
        default="127.0.0.1:48864",
        help="HOST:PORT to listen on (port 0: any free port; default %(default)s)",
    )
    parser.add_argument(
        "--drop-rate",
        type=float,
        default=0.0,
        help="inject seeded loss: drop this fraction of packets in each direction",
    )
    parser.add_argument(
        "--duplicate-rate",
        type=float,
        default=0.0,
        help="inject seeded duplicates in each direction (tests)",
    )
    parser.add_argument(
        "--reorder-rate",
        type=float,
        default=0.0,
        help="hold back this fraction of packets by one (tests)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the injected impairments")
    parser.add_argument(
        "--job-memory",
        type=int,
        default=job_memory_mib,
        metavar="MIB",
        help="slot memory one job may hold (default %(default)s MiB)",
    )
    parser.add_argument(
        "--memory",
        type=int,
        default=4 * job_memory_mib,
        metavar="MIB",
        help="slot memory of all jobs together (default %(default)s MiB)",
    )
    parser.add_argument(
        "--admission-file",
        metavar="PATH",
        help="admission secrets, one per line (NAME SECRET, or SECRET): only requests signed "
        "with one may register jobs or read the aggregator's statistics, and each secret "
        "has its own --max-jobs and --max-memory. Default: $GRADSUM_ADMISSION_FILE, else the "
        "one secret in $GRADSUM_ADMISSION_SECRET, else none (anyone may register: a warning)",
    )
    parser.add_argument(
        "--max-jobs",
        type=int,
        default=256,
        metavar="N",
        help="jobs one admission secret (without secrets: everyone) may hold (default "
        "%(default)s; all together at most 1024)",
    )
    parser.add_argument(
        "--max-memory",
        type=int,
        metavar="MIB",
        help="slot memory one admission secret (without secrets: everyone) may hold "
        "(default: --memory)",
    )
    parser.add_argument(
        "--max-elements",
        type=int,
        default=1 << 24,
        metavar="K",
        help="most lanes per slot/packet a job may register (64 or 256 mimic a hardware switch)",
    )
    parser.add_argument(
        "--register",
        metavar="FILE",
        action="append",
        default=[],
        help="register the job(s) in this JSON file (a spec or a list) at start",
    )
    parser.add_argument(
        "--stats-interval",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="print statistics to stderr this often (0: only on exit and SIGUSR1)",
    )
    parser.add_argument("--stats-json", metavar="PATH", help="write the final statistics here")
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve /metrics (Prometheus text) and /health over HTTP on the --bind host at "
        "this port (pipeline i: PORT+i; 0: any free port, printed at start). Default: off",
    )
    parser.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="log lines on stderr as text or as one JSON object each (default %(default)s)",
    )
    parser.add_argument(
        "--pipelines",
        type=int,
        default=1,
        metavar="N",
        help="run N independent pipelines, each its own process with its own slot pools, on "
        "ports PORT..PORT+N-1 (any free ports with port 0); workers spread a job's lanes over "
        "them as over several aggregators, so a software switch can use N cores (default 1)",
    )


def run_daemon(args: argparse.Namespace, make_profile) -> int:
    from ..cli import UsageError
    from ..dataplane.authentication import load_secrets
    from ..dataplane.jobspec import JobSpec, SpecError
    from ..dataplane.plane import DataPlane, RequestRefused
    from .daemon import Daemon
    from .udp import PortInUseError, open_socket, parse_bind

    _check_flags(args, UsageError)
    global _LOG_JSON
    _LOG_JSON = args.log_format == "json"
    try:
        bind = parse_bind(args.bind)
    except ValueError as error:
        raise UsageError(str(error)) from None
    tenant_memory = (args.max_memory or args.memory) * MIB
    profile = make_profile(args.job_memory * MIB, args.memory * MIB, args.max_elements,
                           max_jobs=MAX_JOBS, tenant_jobs=args.max_jobs,
                           tenant_memory=tenant_memory)  # fmt: skip
    try:
        secrets = load_secrets(args.admission_file)
    except (OSError, ValueError) as error:
        where = "--admission-file: " if args.admission_file else ""  # else: the message names it
        raise UsageError(f"{where}{error}") from None
    if not secrets:
        _report(
            f"gradsum {profile.name}: WARNING: no admission secret (--admission-file, "
            "$GRADSUM_ADMISSION_FILE or $GRADSUM_ADMISSION_SECRET): anyone who can reach this "
            "port may register jobs and read the aggregator's statistics; run it on a trusted "
            "network only", event="no_admission_secret", level="warning",
        )  # fmt: skip
    jobs = []
    for path in args.register:
        try:
            jobs += [JobSpec.from_json(body) for body in _job_bodies(path)]
            _aggregator(profile, jobs, DataPlane)  # refuses what it cannot serve
        except (OSError, ValueError, SpecError, RequestRefused) as error:
            raise UsageError(f"--register {path}: {error}") from None
    sockets = _open_sockets(bind, args.pipelines, open_socket, PortInUseError, UsageError)
    metrics = _open_metrics(bind[0], args.metrics_port, args.pipelines, UsageError)
    addresses = ", ".join("{}:{}".format(*s.getsockname()[:2]) for s in sockets)
    served = "; metrics on " + ", ".join(
        "http://{}:{}".format(*m.address) for m in metrics
    ) if metrics else ""  # fmt: skip
    print(
        f"gradsum {profile.name}: listening on {addresses} (drop rate {args.drop_rate:g}, "
        f"{len(jobs)} jobs registered{served})",
        flush=True,
    )
    args.metrics_servers = metrics
    children = []
    for index in range(1, len(sockets)):
        pid = _fork_pipeline(index, sockets)
        if pid == 0:  # pipeline `index`'s own process: serve, and fork nothing more
            return _serve(args, profile, _aggregator(profile, jobs, DataPlane, secrets),
                          sockets[index], Daemon, index)  # fmt: skip
        children.append(pid)
    for extra in sockets[1:]:
        extra.close()
    try:
        return _serve(args, profile, _aggregator(profile, jobs, DataPlane, secrets), sockets[0],
                      Daemon, 0)  # fmt: skip
    finally:
        _stop_pipelines(children)


def _aggregator(profile, jobs, DataPlane, secrets=None):
    aggregator = DataPlane(profile, secrets=secrets)
    for spec in jobs:
        aggregator.register(spec)
    return aggregator


def _open_sockets(bind, count: int, open_socket, PortInUseError, UsageError) -> list:
    """One bound socket per pipeline (ports PORT.., or free ones for port 0), bound before any
    pipeline starts, so a port in use is one clear error."""
    host, port = bind
    sockets = []
    try:
        for index in range(count):
            sockets.append(open_socket((host, port + index if port else 0)))
    except PortInUseError as error:
        for sock in sockets:
            sock.close()
        raise UsageError(f"--bind: {error.strerror}") from None
    return sockets


def _fork_pipeline(index: int, sockets: list) -> int:
    """Fork the process of pipeline ``index``: it keeps only its own socket. Returns the child's
    pid in the parent and 0 in the child, like ``os.fork``."""
    pid = os.fork()
    if pid == 0:
        for other, sock in enumerate(sockets):
            if other != index:
                sock.close()
    return pid


def _stop_pipelines(children: list[int], timeout: float = 10.0) -> None:
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for pid in children:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.02)


def _serve(args, profile, aggregator, sock, Daemon, index: int) -> int:
    aggregator.port = sock.getsockname()[1]  # signatures name the port they were sent to
    daemon = Daemon(
        aggregator,
        sock,
        drop_rate=args.drop_rate,
        seed=args.seed + 1000 * index,
        duplicate_rate=args.duplicate_rate,
        reorder_rate=args.reorder_rate,
    )
    name = profile.name if args.pipelines == 1 else f"{profile.name} pipeline {index}"
    metrics = args.metrics_servers[index] if args.metrics_servers else None
    for other in args.metrics_servers or ():
        if other is not metrics:
            other.close()  # another pipeline's
    if metrics is not None:
        labels = {"profile": profile.name, "pipeline": str(index)}
        metrics.log = lambda line: _report(line, event="metrics_request_failed", level="warning")
        metrics.start(daemon.statistics, lambda: daemon.last_turn, labels)
    _install_signals(daemon)
    reporter = _start_reporter(daemon, args.stats_interval)
    try:
        daemon.serve()
    finally:
        sock.close()
        if reporter is not None:
            reporter.set()
    if metrics is not None:
        metrics.close()
    final = daemon.statistics_json()
    _report(f"gradsum {name}: stopped; statistics {final}", event="stopped",
            statistics=daemon.statistics())  # fmt: skip
    if args.stats_json:
        path = args.stats_json if index == 0 else f"{args.stats_json}.{index}"
        with open(path, "w") as out:
            out.write(final + "\n")
    return 0


def _open_metrics(host: str, port: int | None, pipelines: int, UsageError) -> list:
    """One bound metrics server per pipeline (ports PORT.., or free ones), or none."""
    if port is None:
        return []
    from .metrics import MetricsServer

    servers = []
    try:
        for index in range(pipelines):
            servers.append(MetricsServer((host, port + index if port else 0)))
    except OSError as error:
        for server in servers:
            server.close()
        raise UsageError(f"--metrics-port: {error.strerror or error}") from None
    return servers


def _check_flags(args, UsageError) -> None:
    for flag in ("drop_rate", "duplicate_rate", "reorder_rate"):
        value = getattr(args, flag)
        if not 0.0 <= value < 1.0:
            raise UsageError(f"--{flag.replace('_', '-')} must be in [0, 1), got {value}")
    for flag, value in (
        ("--job-memory", args.job_memory),
        ("--memory", args.memory),
        ("--max-elements", args.max_elements),
        ("--max-jobs", args.max_jobs),
        ("--max-memory", args.max_memory or 1),
    ):
        if value < 1:
            raise UsageError(f"{flag} must be positive, got {value}")
    if args.max_jobs > MAX_JOBS:
        raise UsageError(f"--max-jobs must be at most {MAX_JOBS} (the jobs of every admission "
                         f"secret together), got {args.max_jobs}")  # fmt: skip
    if args.stats_interval < 0:
        raise UsageError(f"--stats-interval must be >= 0, got {args.stats_interval}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535 - args.pipelines:
        raise UsageError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    if not 1 <= args.pipelines <= 64:
        raise UsageError(f"--pipelines must be in 1..64, got {args.pipelines}")


def _job_bodies(path: str) -> list:
    with open(path) as handle:
        body = json.load(handle)
    return body if isinstance(body, list) else [body]


def _install_signals(daemon) -> None:
    def stop(signum, frame):
        daemon.stop.set()

    def report(signum, frame):
        _report(daemon.statistics_json(), event="statistics", statistics=daemon.statistics())

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGUSR1, report)


def _start_reporter(daemon, interval: float):
    if interval <= 0:
        return None
    done = threading.Event()

    def loop():
        while not done.wait(interval):
            _report(daemon.statistics_json(), event="statistics", statistics=daemon.statistics())

    threading.Thread(target=loop, daemon=True, name="gradsum-stats").start()
    return done


_LOG_JSON = False  # --log-format json


def _report(line: str, event: str = "log", level: str = "info", **fields) -> None:
    """One line to stderr in one write: pipelines share the stream, and ``print`` (text and
    newline written separately when stderr is unbuffered) let their lines interleave. With
    ``--log-format json``, one JSON object per line: time, level, event, pid, and the
    event's fields (a log collector parses them without knowing our text)."""
    if _LOG_JSON:
        record = {"ts": round(time.time(), 3), "level": level, "event": event,
                  "pid": os.getpid(), **(fields or {"message": line})}  # fmt: skip
        line = json.dumps(record, sort_keys=True)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
