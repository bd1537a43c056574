"""Fixtures for tests that build real testbeds: skip only where namespaces are unavailable, and
check after every test, passed or failed, that nothing it made is left behind."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess

import pytest

from gradsum.testbed import Testbed, shell
from gradsum.testbed.plan import owned_namespaces

_counter = itertools.count()


def _namespaces_unavailable() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    if any(shutil.which(tool) is None for tool in ("ip", "tc", "sysctl")):
        return "iproute2 (ip, tc) or procps (sysctl) is not installed"
    probe = f"gradsum-probe{os.getpid()}"
    try:
        done = subprocess.run(
            ["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10
        )
    except subprocess.TimeoutExpired:
        return "`ip netns add` hung"
    if done.returncode != 0:
        return f"`ip netns add` fails here: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10, check=True)
    return None


@pytest.fixture(scope="session")
def namespaces():
    reason = _namespaces_unavailable()
    if reason:
        pytest.skip(reason)


def host_interfaces() -> str:
    """The host namespace's links and qdiscs, without counters."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10)
    qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True, timeout=10)
    names = sorted(line.split(":")[1].strip() for line in links.stdout.splitlines())
    return "\n".join(names) + "\n" + qdiscs.stdout


@pytest.fixture
def make_testbed(namespaces, tmp_path, monkeypatch):
    """``make_testbed(**options)``: an unbuilt Testbed with a fresh id. Afterwards, also when
    the test failed midway, every testbed it made is removed and the host must look as before."""
    monkeypatch.setenv(shell.STATE_DIR_ENV, str(tmp_path / "state"))
    before = host_interfaces()
    made: list[str] = []

    def make(workers: int = 2, **options) -> Testbed:
        testbed_id = options.pop("id", None) or f"t{os.getpid()}x{next(_counter)}"
        made.append(testbed_id)
        return Testbed(workers, id=testbed_id, **options)

    yield make
    for testbed_id in made:
        shell.remove(testbed_id)  # a no-op for those the test already took down
    present = shell.list_namespaces()
    assert [ns for i in made for ns in owned_namespaces(present, i)] == []
    assert host_interfaces() == before
