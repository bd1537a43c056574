"""What the data plane asks its shell to do. Plain tuples: one is built per packet."""

from __future__ import annotations

from typing import NamedTuple

from .jobspec import Address

MULTICAST = "multicast"  # a completed slot, to every worker of the job
UNICAST = "unicast"  # a kept result, to the one worker that asked again
FORWARD = "forward"  # a partial sum, up to the parent switch
STALE = "stale"  # tell a worker its chunk's result is gone (it fell behind a quorum)
REPLY = "reply"  # a control reply


class Send(NamedTuple):
    what: str
    destinations: tuple[Address, ...]
    header: bytes
    payload: bytes | memoryview = b""


class Store(NamedTuple):
    """A contribution entered a slot (no packet goes out)."""

    job: int
    slot: int
    version: int
    chunk: int


class Drop(NamedTuple):
    reason: str  # a counter name, e.g. "unknown_job", "duplicate"
    detail: str = ""
