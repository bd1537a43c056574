"""The executor: applies a plan with ``ip``/``tc`` and removes a testbed, found by name.

Thin: every decision is in ``plan``; this module runs commands (each with a timeout), turns
failures into errors that name the problem, and keeps one small state file per testbed so a fresh
process (``gradsum testbed status``/``down``/``exec``) knows what is up.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from .plan import (
    ID_PATTERN,
    TestbedPlan,
    TestbedSpec,
    ids_from_namespaces,
    owned_namespaces,
    parse_netns_list,
)

COMMAND_TIMEOUT_S = 20.0
KILL_GRACE_S = 3.0
STATE_DIR_ENV = "GRADSUM_TESTBED_STATE_DIR"
DEFAULT_STATE_DIR = "/run/gradsum/testbed"
INSTALL_HINT = "install iproute2 and procps (Debian/Ubuntu: apt-get install -y iproute2 procps)"


class TestbedError(RuntimeError):
    """The testbed cannot be built, used or removed; the message says why."""

    __test__ = False  # not a pytest test class


def preflight(euid: int | None = None, which=shutil.which) -> None:
    """Raise TestbedError unless we are root and ``ip``, ``tc`` and ``sysctl`` are on PATH."""
    euid = os.geteuid() if euid is None else euid
    if euid != 0:
        raise TestbedError(
            "the testbed needs root (CAP_NET_ADMIN) to create network namespaces and shape "
            "links; run as root, e.g. with sudo"
        )
    for tool in ("ip", "tc", "sysctl"):
        if which(tool) is None:
            raise TestbedError(f"'{tool}' not found on PATH: {INSTALL_HINT}")


def run_command(argv: tuple[str, ...] | list[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
    """Run one command; return its stdout, or raise TestbedError naming it and its stderr."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise TestbedError(f"'{argv[0]}' not found on PATH: {INSTALL_HINT}") from None
    except subprocess.TimeoutExpired:
        raise TestbedError(f"`{' '.join(argv)}` did not finish within {timeout:g} s") from None
    if done.returncode != 0:
        raise TestbedError(explain_failure(argv, done.stderr.strip(), done.returncode))
    return done.stdout


def explain_failure(argv: tuple[str, ...] | list[str], stderr: str, returncode: int) -> str:
    """An error message for a failed ``ip``/``tc`` command, with the likely cause when known."""
    message = f"`{' '.join(argv)}` failed (exit {returncode}): {stderr or 'no message'}"
    if "netem" in argv and "unknown" in stderr:
        return message + (
            "; link delay needs the kernel's netem qdisc (CONFIG_NET_SCH_NETEM), which this "
            "kernel lacks: use a delay of 0 here"
        )
    if "bpf" in argv and ("unknown" in stderr.lower() or "Unknown filter" in stderr):
        return message + "; link loss needs the kernel's BPF classifier (CONFIG_NET_CLS_BPF)"
    if argv[:3] == ("ip", "netns", "add"):
        return message + "; network namespaces are unavailable here"
    return message


def list_namespaces() -> list[str]:
    return parse_netns_list(run_command(("ip", "netns", "list")))


def namespace_pids(namespace: str) -> list[int]:
    try:
        out = run_command(("ip", "netns", "pids", namespace))
    except TestbedError:
        return []  # the namespace went away meanwhile
    return [int(pid) for pid in out.split()]


def kill_namespace_processes(namespaces: list[str], grace: float = KILL_GRACE_S) -> None:
    """SIGTERM every process inside ``namespaces``; SIGKILL those alive after ``grace`` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [pid for ns in namespaces for pid in namespace_pids(ns)]
        for pid in pids:
            _signal(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = [pid for pid in pids if _alive(pid)]
        if not pids:
            return


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False


def remove(testbed_id: str) -> list[str]:
    """Remove testbed ``testbed_id``: its processes, namespaces (with every veth, bridge and
    qdisc in them) and state file. Works on a half-built or crashed testbed. Returns the
    namespaces it deleted; raises TestbedError if any is left."""
    namespaces = owned_namespaces(list_namespaces(), testbed_id)
    kill_namespace_processes(namespaces)
    for ns in namespaces:
        run_command(("ip", "netns", "del", ns))
    state_path(testbed_id).unlink(missing_ok=True)
    left = owned_namespaces(list_namespaces(), testbed_id)
    if left:
        raise TestbedError(f"testbed {testbed_id!r}: could not delete {', '.join(left)}")
    return namespaces


def apply(plan: TestbedPlan) -> None:
    """Build ``plan``, first removing whatever a stale testbed of the same id left. On any
    failure the partial testbed is removed and TestbedError raised."""
    preflight()
    remove(plan.spec.id)
    write_state(plan.spec)
    try:
        for argv in plan.commands():
            run_command(argv)
    except BaseException:
        remove(plan.spec.id)
        raise


def running_ids() -> list[str]:
    """Ids of testbeds that have namespaces or a state file."""
    return sorted(set(ids_from_namespaces(list_namespaces())) | set(saved_ids()))


# --- state files ---


def state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV, DEFAULT_STATE_DIR))


def state_path(testbed_id: str) -> Path:
    return state_dir() / f"{testbed_id}.json"


def claim(testbed_id: str):
    """Hold testbed ``testbed_id`` for this process until the returned file is closed.

    ``apply`` rebuilds a testbed whose id is taken, which is right for one a crashed run left
    behind but would tear down one that another process is still using (two benchmarks with
    the same id). An advisory lock on ``<id>.lock``, released when its holder exits however it
    exits, tells the two apart."""
    path = state_dir() / f"{testbed_id}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+")  # noqa: SIM115 -- held open for the testbed's lifetime
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise TestbedError(
            f"testbed {testbed_id!r} is in use by {holder}; wait for it to finish "
            "or use another testbed id"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def write_state(spec: TestbedSpec) -> None:
    path = state_path(spec.id)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(spec.to_json() + "\n")
    temporary.replace(path)


def read_state(testbed_id: str) -> TestbedSpec | None:
    try:
        return TestbedSpec.from_json(state_path(testbed_id).read_text())
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as error:
        raise TestbedError(f"state file {state_path(testbed_id)} is corrupt: {error}") from None


def saved_ids() -> list[str]:
    directory = state_dir()
    if not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.glob("*.json") if ID_PATTERN.fullmatch(p.stem))
