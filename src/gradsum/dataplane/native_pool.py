"""Slot pools of integer-sum jobs in C (``_pool.c``): ``SlotPool``'s decisions without the
interpreter, and a daemon loop that handles their packets end to end.

A switch spends most of its time on the DATA packets of integer jobs (bfp, THC); in Python each
costs ~30 us of interpreter time on top of the kernel's copies. ``NativePool`` holds such a job's
slots in C and answers ``on_data`` exactly as ``SlotPool`` does (tests compare them packet by
packet); ``serve`` (used by ``net.daemon``) receives, aggregates and sends for all native jobs
and hands every other datagram to the Python aggregator.

A job is native when the extension is built, ``GRADSUM_NATIVE`` is not 0, its op is an integer
sum of int32 lanes or of indices of up to 8 bits (its table of at most 256 entries), it has no
quorum and no parent, and its workers and group are IPv4.
"""

from __future__ import annotations

import numpy as np

from ..codecs.lanes import packed_nbytes
from . import actions
from .actions import Drop, Send, Store
from .jobspec import IntegerSum, JobSpec, is_ipv4
from .packet import Header
from .slots import resident_zeros

try:
    from . import _pool
except ImportError:  # built without a C compiler
    _pool = None

MULTICAST, UNICAST, STALE, DROP = 1, 2, 3, 4  # _pool.c's actions
_WHAT = {MULTICAST: actions.MULTICAST, UNICAST: actions.UNICAST, STALE: actions.STALE}


def serves(spec: JobSpec) -> bool:
    from ..codecs.native_common import enabled

    op = spec.op
    return (
        _pool is not None
        and enabled()
        and isinstance(op, IntegerSum)
        and (op.signed or op.in_bits <= 8)
        and not spec.quorum
        and spec.parent is None
        and spec.integrity == "token"
        and all(
            is_ipv4(host) for host, _ in (*spec.addresses, *([spec.group] if spec.group else []))
        )
    )


class NativePool:
    """``SlotPool``'s interface for one native job."""

    def __init__(self, spec: JobSpec):
        op = spec.op
        table = () if op.signed else (op.table or tuple(range(1 << op.in_bits)))
        self.spec = spec
        self.acc = resident_zeros((2, spec.slots, spec.elements))  # as SlotPool's
        self.core = _pool.Pool(
            spec.job, spec.slots, spec.elements, spec.max_contributors, op.in_bits, op.out_bits,
            op.signed, table, list(spec.addresses), spec.group, True, self.acc, spec.token,
        )  # fmt: skip

    @staticmethod
    def memory(spec: JobSpec) -> int:
        """Bytes the pool holds (``_pool.c``): per round of each slot's two, the int32
        accumulator, a seen byte per worker, the round's fields and (narrow sums) its packed
        result."""
        op = spec.op
        packed = 0 if op.signed else packed_nbytes(spec.elements, op.out_bits) + 8
        per_round = 4 * spec.elements + spec.workers + _pool.ROUND_BYTES + packed
        return 2 * spec.slots * per_round

    def on_data(self, header: Header, payload: memoryview, now: float) -> list:
        stored, action, *rest = self.core.process(
            header.worker, header.slot, header.version, int(header.op), header.flags,
            header.chunk, header.elements, header.contributors, payload, header.token,
        )  # fmt: skip
        done = [Store(self.spec.job, header.slot, header.version, header.chunk)] if stored else []
        if action == DROP:
            return [*done, Drop(rest[0])]
        if action:
            worker, head, data = rest
            return [*done, Send(_WHAT[action], self._destinations(action, worker), head, data)]
        return done

    def _destinations(self, action: int, worker: int) -> tuple:
        if action != MULTICAST:
            return (self.spec.addresses[worker],)
        return (self.spec.group,) if self.spec.group else self.spec.addresses

    def on_parent_result(self, header: Header, payload: memoryview) -> list:
        return [Drop("unexpected", "a native job has no parent")]

    def on_tick(self, now: float) -> list:
        return []

    def next_deadline(self) -> float | None:
        return None

    @property
    def stats(self) -> dict[str, int]:
        return self.core.stats()


def serve(fd: int, pools: list, buffer: bytearray, loss: Loss, limit: int = 256):
    """Handle queued datagrams of native jobs; (handled, sent, send failures, size, source) with
    ``size`` > 0 when a datagram for the Python aggregator waits in ``buffer``."""
    handled, sent, failures, dropped_in, dropped_out, size, source = _pool.serve(
        fd, pools, buffer, limit, loss.drop_in, loss.drop_out, loss.state
    )
    loss.dropped_in += dropped_in
    loss.dropped_out += dropped_out
    return handled, sent, failures, size, source


class Loss:
    """Injected loss for the native loop: rates each way and the seeded generator's state."""

    def __init__(self, drop_in: float = 0.0, drop_out: float = 0.0, seed: int = 0):
        self.drop_in, self.drop_out = drop_in, drop_out
        # xorshift needs a non-zero state; splitmix the seed into one
        mixed = (seed + 0x9E3779B97F4A7C15) * 0xBF58476D1CE4E5B9 % (1 << 64)
        self.state = np.array([mixed or 1], dtype=np.uint64)
        self.dropped_in = self.dropped_out = 0
