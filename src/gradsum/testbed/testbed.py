"""The Python API: a testbed as a context manager, and ways to run things on its hosts.

    with Testbed(workers=4, switch=True, rate="1gbit") as tb:
        tb.run("w0", ["python", "-c", "print('hi')"])
        server = tb.popen("switch", ["gradsum", "switch", ...])
        result = tb.call("w1", some_module.function, args=(1, 2))

Leaving the ``with`` block (also by an exception) stops the processes it started and removes
the testbed. While it is up, a SIGTERM to a main thread that has no handler of its own raises
SystemExit there, so ``kill`` removes the testbed too (only SIGKILL leaves it behind; then
``gradsum testbed down --id ID`` removes it).

Every process started on a host gets ``GRADSUM_TESTBED_*`` variables that tell it the testbed
id, its host name and address, and every host's address.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

from . import shell
from .plan import Host, TestbedPlan, TestbedSpec, parse_loss_drops, plan
from .shell import TestbedError
from .units import parse_duration, parse_loss, parse_rate

DEFAULT_TIMEOUT_S = 60.0
STOP_GRACE_S = 3.0


def _raise_system_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _exit_on_sigterm():
    """Make SIGTERM raise SystemExit, so ``with Testbed`` blocks unwind and remove their
    testbed; return the handler to restore, or None where this process's SIGTERM is not the
    default (someone else handles it) or this is not the main thread (Python only lets the main
    thread set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _raise_system_exit)


class RemoteError(TestbedError):
    """A function run on a testbed host raised; the message carries its traceback."""


def make_spec(
    workers: int = 2,
    *,
    switch: bool = False,
    ps: int = 0,
    rate: str | int | None = None,
    delay: str | float = 0.0,
    loss: str | float = 0.0,
    queue: str | float = 0.02,
    id: str = "0",
) -> TestbedSpec:
    """A TestbedSpec from user values: strings (``"1gbit"``, ``"5ms"``, ``"1%"``) or numbers
    (bit/s, seconds, fractions)."""
    return TestbedSpec(
        id=id,
        workers=workers,
        switch=switch,
        ps=ps,
        rate=parse_rate(rate) if isinstance(rate, str) else rate,
        delay=parse_duration(delay) if isinstance(delay, str) else float(delay),
        loss=parse_loss(loss) if isinstance(loss, str) else float(loss),
        queue=parse_duration(queue) if isinstance(queue, str) else float(queue),
    )


class Testbed:
    """An emulated cluster; see the module docstring. Arguments as for ``make_spec``."""

    __test__ = False  # not a pytest test class

    def __init__(self, workers: int = 2, **options: Any) -> None:
        self.spec = options.pop("spec", None) or make_spec(workers, **options)
        self.plan: TestbedPlan = plan(self.spec)
        self._processes: list[subprocess.Popen] = []
        self._claim = None  # the lock that marks this testbed as in use (shell.claim)
        self._sigterm = None  # the SIGTERM handler to restore when the testbed is down

    @classmethod
    def attach(cls, testbed_id: str) -> Testbed:
        """The testbed ``testbed_id`` that is up (made by another process), from its state file."""
        spec = shell.read_state(testbed_id)
        if spec is None:
            raise TestbedError(
                f"testbed {testbed_id!r} is not up (no {shell.state_path(testbed_id)})"
            )
        return cls(spec=spec)

    # --- lifecycle ---

    def up(self) -> Testbed:
        self._claim = shell.claim(self.spec.id)
        try:
            self._sigterm = _exit_on_sigterm()
            shell.apply(self.plan)
        except BaseException:
            self._release()
            raise
        return self

    def down(self) -> None:
        try:
            self.stop_processes()
            shell.remove(self.spec.id)
        finally:
            self._release()

    def _release(self) -> None:
        if self._claim is not None:
            self._claim.close()
            self._claim = None
        if self._sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = None

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc_info: object) -> None:
        self.down()

    # --- hosts ---

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def workers(self) -> list[str]:
        return [h.name for h in self.plan.workers]

    @property
    def servers(self) -> list[str]:
        return [h.name for h in self.plan.servers]

    def host(self, name: str) -> Host:
        return self.plan.host(name)

    def address(self, name: str) -> str:
        address = self.host(name).address
        if address is None:
            raise TestbedError(f"host {name!r} has no address")
        return address

    def environment(self, name: str) -> dict[str, str]:
        """The ``GRADSUM_TESTBED_*`` variables of processes on host ``name``."""
        hosts = ",".join(f"{h.name}={h.address}" for h in self.plan.hosts if h.address)
        return {
            "GRADSUM_TESTBED": self.id,
            "GRADSUM_TESTBED_HOST": name,
            "GRADSUM_TESTBED_ADDR": self.host(name).address or "",
            "GRADSUM_TESTBED_HOSTS": hosts,
        }

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside host ``name``'s namespace."""
        if not argv:
            raise TestbedError("empty command")
        return ["ip", "netns", "exec", self.host(name).namespace, *argv]

    def _env(self, name: str, env: dict[str, str] | None) -> dict[str, str]:
        return {**os.environ, **self.environment(name), **(env or {})}

    # --- processes ---

    def run(
        self,
        name: str,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        check: bool = True,
        env: dict[str, str] | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on host ``name`` and wait (at most ``timeout`` s); text output captured."""
        command = self.command(name, argv)
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                input=input,
                timeout=timeout,
                env=self._env(name, env),
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise TestbedError(f"{name}: `{' '.join(argv)}` ran over {timeout:g} s") from None
        if check and done.returncode != 0:
            raise TestbedError(
                f"{name}: `{' '.join(argv)}` exited {done.returncode}: {done.stderr.strip()}"
            )
        return done

    def popen(
        self, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen:
        """Start ``argv`` on host ``name``; it is stopped when the testbed goes down."""
        process = subprocess.Popen(self.command(name, argv), env=self._env(name, env), **kwargs)
        self._processes.append(process)
        return process

    def run_module(
        self, name: str, module: str, args: Sequence[str] = (), **kwargs: Any
    ) -> subprocess.CompletedProcess:
        """``python -m module args`` on host ``name`` with this interpreter; as ``run``."""
        return self.run(name, [sys.executable, "-m", module, *args], **kwargs)

    def start_call(
        self,
        name: str,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Call:
        """Start ``fn(*args, **kwargs)`` in a fresh Python process on host ``name``; ``fn``
        must be importable by reference (a module-level function)."""
        if getattr(fn, "__module__", None) == "__main__":
            raise TestbedError(f"{fn.__qualname__} is defined in __main__: move it to a module")
        payload = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
        stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed by Call.result)
        env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        process = self.popen(
            name,
            [sys.executable, "-m", "gradsum.testbed.child"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        assert process.stdin is not None
        process.stdin.write(payload)
        process.stdin.close()
        process.stdin = None  # so that communicate() does not touch it
        return Call(name, fn.__qualname__, process, stderr)

    def call(
        self,
        name: str,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> Any:
        """``fn(*args, **kwargs)`` run on host ``name``; its result, or RemoteError."""
        return self.start_call(name, fn, args, kwargs).result(timeout)

    def loss_drops(self) -> dict[str, int]:
        """Packets the loss rule dropped so far on each link end, keyed ``w0>`` (leaving w0)
        and ``>w0`` (arriving at w0)."""
        drops = {}
        for link in self.plan.links:
            ends = ((f"{link.host}>", link.namespace, link.device),
                    (f">{link.host}", link.peer_namespace, link.peer))  # fmt: skip
            for key, namespace, device in ends:
                stats = shell.run_command(
                    ("tc", "-n", namespace, "-s", "qdisc", "show", "dev", device)
                )
                drops[key] = parse_loss_drops(stats)
        return drops

    def stop_processes(self) -> None:
        """Stop (SIGTERM, then SIGKILL) every process this object started."""
        for process in self._processes:
            stop(process)
        self._processes.clear()


def stop(process: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """Terminate ``process`` and reap it; SIGKILL it if it ignores SIGTERM for ``grace`` s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=grace)
    for stream in (process.stdin, process.stdout, process.stderr):
        if stream is not None:
            stream.close()


class Call:
    """A function running on a testbed host; ``result()`` waits for its value."""

    def __init__(self, host: str, what: str, process: subprocess.Popen, stderr: Any) -> None:
        self.host = host
        self.what = what
        self.process = process
        self._stderr = stderr

    def result(self, timeout: float = DEFAULT_TIMEOUT_S) -> Any:
        try:
            return self._result(timeout)
        finally:
            self._stderr.close()

    def _result(self, timeout: float) -> Any:
        try:
            out, _ = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(self.process)
            raise TestbedError(
                f"{self.host}: {self.what} did not finish within {timeout:g} s{self._tail()}"
            ) from None
        if not out:
            raise TestbedError(
                f"{self.host}: {self.what} died (exit {self.process.returncode}){self._tail()}"
            )
        reply = pickle.loads(out)
        if reply[0] == "error":
            _, kind, message, trace = reply
            raise RemoteError(f"{self.host}: {self.what} raised {kind}: {message}\n{trace}")
        return reply[1]

    def _tail(self, limit: int = 2000) -> str:
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace").strip()
        return f"; stderr: {text[-limit:]}" if text else ""
