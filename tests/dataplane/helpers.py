"""Small builders shared by the data-plane tests."""

from __future__ import annotations

import numpy as np

from gradsum.dataplane import DataPlane, Header, IntegerSum, JobSpec, Kind, Op, switch_profile
from gradsum.dataplane.actions import Drop, Send, Store

SWITCH = ("10.0.0.1", 48864)


def worker_address(worker: int) -> tuple[str, int]:
    return ("10.0.1.1", 5000 + worker)


def int32_job(workers=3, slots=2, elements=8, job=1, **extra) -> JobSpec:
    addresses = tuple(worker_address(w) for w in range(workers))
    return JobSpec(job, addresses, slots, elements, IntegerSum(32, 32, True), **extra)


def switch_with(*specs: JobSpec) -> DataPlane:
    aggregator = DataPlane(switch_profile())
    for spec in specs:
        aggregator.register(spec)
    return aggregator


def data_packet(spec: JobSpec, worker: int, chunk: int, values, op=Op.SUM, flags=0,
                contributors=1) -> bytes:  # fmt: skip
    lanes = np.asarray(values, dtype="<i4")
    s = spec.slots
    header = Header(Kind.DATA, spec.job, worker, chunk % s, (chunk // s) % 2, op, flags, chunk,
                    lanes.size, contributors, spec.token)  # fmt: skip
    return header.pack() + lanes.tobytes()


def send(aggregator, spec, worker, chunk, values, now=0.0, **options):
    packet = data_packet(spec, worker, chunk, values, **options)
    return aggregator.on_datagram(memoryview(packet), spec.addresses[worker], now)


def sends(actions, what=None):
    return [a for a in actions if isinstance(a, Send) and (what is None or a.what == what)]


def drops(actions):
    return [a.reason for a in actions if isinstance(a, Drop)]


def stores(actions):
    return [a for a in actions if isinstance(a, Store)]


def lanes_of(action: Send) -> list[int]:
    return np.frombuffer(bytes(action.payload), dtype="<i4").tolist()
