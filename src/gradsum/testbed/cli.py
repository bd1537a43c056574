"""`gradsum testbed up|down|status|exec`: an emulated cluster of namespaces with shaped links."""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_ID = "0"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "testbed",
        help="emulated cluster on this host: network namespaces with shaped, lossy links",
        description="Build, inspect, use and remove an emulated cluster: one network namespace "
        "per host (workers w0.., parameter servers ps0.., the switch), each worker and server "
        "linked to a bridge standing for the top-of-rack switch over a link shaped with tc. "
        "Needs root and iproute2. See docs/testbed.md.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    _add_up(actions)
    down = actions.add_parser("down", help="remove a testbed (also a crashed, half-built one)")
    group = down.add_mutually_exclusive_group()
    group.add_argument("--id", default=DEFAULT_ID, help=f"testbed id (default {DEFAULT_ID})")
    group.add_argument("--all", action="store_true", help="remove every gradsum testbed")
    status = actions.add_parser("status", help="list the testbeds that are up and their hosts")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    run_on = actions.add_parser(
        "exec",
        help="run a command on a testbed host",
        usage="gradsum testbed exec [--id ID] HOST -- CMD [ARG ...]",
        description="Run CMD inside HOST's namespace, with GRADSUM_TESTBED_* variables telling "
        "it the testbed id, its host name and address, and every host's address.",
    )
    run_on.add_argument("--id", default=DEFAULT_ID, help=f"testbed id (default {DEFAULT_ID})")
    run_on.add_argument("host", help="host name: w0, w1, ..., ps0, ..., switch")
    run_on.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    parser.set_defaults(run=run)


def _add_up(actions: argparse._SubParsersAction) -> None:
    from .units import parse_duration, parse_loss, parse_rate

    up = actions.add_parser(
        "up",
        help="build a testbed (an old one with the same id is removed first)",
        description="Build a testbed. Rate, delay and loss apply to each direction of every "
        "link; a worker-to-worker path crosses two links, a worker-to-switch path one.",
    )
    up.add_argument("--id", default=DEFAULT_ID, help=f"testbed id (default {DEFAULT_ID})")
    up.add_argument("--workers", type=int, default=4, help="worker hosts w0.. (default 4)")
    up.add_argument("--switch", action="store_true", help="add host 'switch' (in the ToR)")
    up.add_argument("--ps", type=int, default=0, help="parameter-server hosts ps0.. (default 0)")
    up.add_argument("--rate", type=_typed(parse_rate), help="link rate, e.g. 100mbit, 1gbit")
    up.add_argument(
        "--delay", type=_typed(parse_duration), default=0.0, help="one-way link delay, e.g. 1ms"
    )
    up.add_argument("--loss", type=_typed(parse_loss), default=0.0, help="link loss, e.g. 1%%")
    up.add_argument(
        "--queue",
        type=_typed(parse_duration),
        default=0.02,
        help="link queue, as time at line rate (default 20ms)",
    )


def _typed(parse):
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    return convert


def run(args: argparse.Namespace) -> int:
    from .shell import TestbedError

    try:
        return ACTIONS[args.action](args)
    except TestbedError as error:
        print(f"gradsum testbed {args.action}: error: {error}", file=sys.stderr)
        return 1


def _up(args: argparse.Namespace) -> int:
    from ..cli import UsageError
    from .plan import TestbedSpec
    from .testbed import Testbed

    try:
        spec = TestbedSpec(
            id=args.id, workers=args.workers, switch=args.switch, ps=args.ps,
            rate=args.rate, delay=args.delay, loss=args.loss, queue=args.queue,
        )  # fmt: skip
    except ValueError as error:
        raise UsageError(str(error)) from None
    tb = Testbed(spec=spec).up()
    print(describe_text(spec, list(tb.plan.namespaces)))
    print(f"run on a host: gradsum testbed exec --id {spec.id} w0 -- CMD")
    return 0


def _down(args: argparse.Namespace) -> int:
    from . import shell

    shell.preflight()
    ids = shell.running_ids() if args.all else [args.id]
    for testbed_id in ids:
        removed = shell.remove(testbed_id)
        what = f"removed {len(removed)} namespaces" if removed else "nothing to remove"
        print(f"testbed {testbed_id}: {what}")
    if not ids:
        print("no gradsum testbed is up")
    return 0


def _status(args: argparse.Namespace) -> int:
    from . import shell

    shell.preflight()
    present = shell.list_namespaces()
    reports = [describe(i, shell.read_state(i), present) for i in shell.running_ids()]
    if args.json:
        print(json.dumps(reports, indent=2))
    elif not reports:
        print("no gradsum testbed is up")
    for report in [] if args.json else reports:
        print(report_text(report))
    return 0


def _exec(args: argparse.Namespace) -> int:
    import os

    from ..cli import UsageError
    from .testbed import Testbed

    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not command:
        raise UsageError("exec needs a command after the host, e.g. exec w0 -- ip addr")
    tb = Testbed.attach(args.id)
    try:
        argv = tb.command(args.host, command)
    except KeyError as error:
        raise UsageError(error.args[0]) from None
    os.execvpe(argv[0], argv, {**os.environ, **tb.environment(args.host)})
    return 127  # not reached


ACTIONS = {"up": _up, "down": _down, "status": _status, "exec": _exec}


def describe(testbed_id: str, spec, present: list[str]) -> dict:
    """Status of one testbed from its saved spec (or None) and the namespaces that exist."""
    from .plan import owned_namespaces, plan

    found = owned_namespaces(present, testbed_id)
    if spec is None:
        return {"id": testbed_id, "state": "stale (no state file)", "namespaces": found}
    expected = plan(spec).namespaces
    missing = sorted(set(expected) - set(found))
    state = "up" if not missing else "broken (missing " + ", ".join(missing) + ")"
    hosts = {h.name: {"namespace": h.namespace, "address": h.address} for h in plan(spec).hosts}
    return {"id": testbed_id, "state": state, "spec": json.loads(spec.to_json()),
            "hosts": hosts, "namespaces": found}  # fmt: skip


def report_text(report: dict) -> str:
    lines = [f"testbed {report['id']}: {report['state']}"]
    if "spec" in report:
        lines.append("  " + spec_summary(report["spec"]))
        for name, host in report["hosts"].items():
            lines.append(f"  {name:<8} {host['namespace']:<24} {host['address'] or ''}")
    else:
        lines += [f"  {ns}" for ns in report["namespaces"]]
        lines.append(f"  remove with: gradsum testbed down --id {report['id']}")
    return "\n".join(lines)


def describe_text(spec, namespaces: list[str]) -> str:
    return report_text(describe(spec.id, spec, namespaces))


def spec_summary(spec: dict) -> str:
    from .units import format_loss, format_rate

    rate = format_rate(spec["rate"]) if spec["rate"] else "unshaped"
    switch = "yes" if spec["switch"] else "no"
    return (
        f"{spec['workers']} workers, {spec['ps']} PS hosts, switch {switch}; "
        f"links {rate}, delay {spec['delay'] * 1e3:g}ms, loss {format_loss(spec['loss'])}, "
        f"queue {spec['queue'] * 1e3:g}ms"
    )
