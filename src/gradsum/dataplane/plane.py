"""A switch or parameter server as a pure state machine: datagrams in, actions out.

``DataPlane.on_datagram(data, source, now)`` parses and validates a packet, routes it to its
job's ``SlotPool`` (data), to the pool that forwarded it (a parent switch's result) or to the
control handlers (registration, teardown, statistics), and returns what to send. Nothing here
touches a socket or a clock: ``now`` and the source address come from the shell.

A packet that fails a check is dropped and counted under its reason, at the level that owns it:
anything not yet attributed to a job and worker (bad header, unknown job or worker, wrong source)
is counted by the aggregator, so it can never touch any job's state.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from . import actions, native_pool
from .actions import Drop, Send
from .combiners import DecodeSumEncodeOp, FloatSumOp, IntegerSumOp
from .jobspec import Address, IntegerSum, JobSpec, SpecError
from .native_pool import NativePool
from .packet import HEADER_SIZE, Header, Kind, MalformedPacket, parse_header
from .slots import SlotPool


@dataclass(frozen=True)
class Profile:
    """What an aggregator may run: a switch adds integers in bounded memory; a server may also
    sum floats and decode-sum-encode."""

    name: str
    integer_only: bool
    job_memory: int  # bytes of slot state one job may hold
    total_memory: int  # bytes for all jobs together
    max_jobs: int = 256
    max_elements: int = 1 << 24  # lanes per slot: 64 or 256 mimic a hardware switch's packets

    def refuse(self, spec: JobSpec) -> str | None:
        """Why this profile cannot serve ``spec`` (None: it can)."""
        if spec.elements > self.max_elements:
            limit = self.max_elements
            return f"{spec.elements} elements per slot exceed this {self.name}'s {limit}"
        if self.integer_only and not isinstance(spec.op, IntegerSum):
            return f"a {self.name} runs integer operations only, not {spec.op.kind}"
        if not self.integer_only and spec.parent is not None:
            return "only a switch forwards to a parent"
        return None


def switch_profile(
    job_memory: int = 256 << 20, total_memory: int = 1 << 30, max_elements: int = 1 << 24
) -> Profile:
    return Profile("switch", True, job_memory, total_memory, max_elements=max_elements)


def server_profile(
    job_memory: int = 1 << 30, total_memory: int = 4 << 30, max_elements: int = 1 << 24
) -> Profile:
    return Profile("server", False, job_memory, total_memory, max_elements=max_elements)


def slot_memory(spec: JobSpec) -> int:
    """Bytes of slot state: int32 lanes x slots x 2 versions (+ kept copies on a server)."""
    lanes = 2 * spec.slots * spec.elements * 4
    return lanes if isinstance(spec.op, IntegerSum) else lanes * (1 + spec.workers)


class Job:
    def __init__(self, spec: JobSpec, native: bool = True):
        self.spec = spec
        self.native = native and native_pool.serves(spec)
        self.pool = NativePool(spec) if self.native else SlotPool(spec, _sum_op(spec))


class DataPlane:
    def __init__(
        self,
        profile: Profile,
        resolve: Callable[[Address], Address] | None = None,
        native: bool = True,
    ):
        self.profile = profile
        self.resolve = resolve or (lambda address: address)
        self.native = native  # integer jobs' pools in C where they can be (native_pool)
        self.jobs: dict[int, Job] = {}
        self._children: dict[tuple[Address, int], int] = {}  # (parent, parent job) -> our job
        self.stats: dict[str, int] = {}

    # -- the one entry point for packets ----------------------------------------------------
    def on_datagram(self, data: memoryview, source: Address, now: float) -> list:
        self.count("datagrams")
        try:
            header = parse_header(data)
        except MalformedPacket as error:
            return [self._drop(error.reason, str(error))]
        payload = data[HEADER_SIZE:]
        if header.kind is Kind.DATA:
            return self._on_data(header, payload, source, now)
        if header.kind is Kind.RESULT:
            return self._on_parent_result(header, payload, source)
        if header.kind in _CONTROL:
            return [self._on_control(header, payload, source)]
        return [self._drop("unexpected_kind", header.kind.name)]

    def _on_data(self, header: Header, payload: memoryview, source: Address, now: float):
        job = self.jobs.get(header.job)
        if job is None:
            return [self._drop("unknown_job", str(header.job))]
        if header.worker >= job.spec.workers:
            return [self._drop("unknown_worker", f"job {header.job} worker {header.worker}")]
        if job.spec.addresses[header.worker] != source:
            return [self._drop("wrong_source", f"{source} is not worker {header.worker}")]
        return job.pool.on_data(header, payload, now)

    def _on_parent_result(self, header: Header, payload: memoryview, source: Address):
        job_id = self._children.get((source, header.job))
        if job_id is None:
            return [self._drop("unexpected_result", f"from {source} for job {header.job}")]
        return self.jobs[job_id].pool.on_parent_result(header, payload)

    def on_tick(self, now: float) -> list:
        done: list = []
        for job in self.jobs.values():
            if job.spec.quorum:
                done += job.pool.on_tick(now)
        return done

    def next_deadline(self) -> float | None:
        deadlines = [j.pool.next_deadline() for j in self.jobs.values() if j.spec.quorum]
        return min((d for d in deadlines if d is not None), default=None)

    # -- control ----------------------------------------------------------------------------
    def _on_control(self, header: Header, payload: memoryview, source: Address) -> Send:
        self.count(f"control_{header.kind.name.lower()}")
        try:
            if header.kind is Kind.REGISTER:
                spec = JobSpec.from_json(_json_body(payload))
                if spec.job != header.job:
                    raise SpecError(f"header job {header.job} != body job {spec.job}")
                self.register(spec)
                return _reply(Kind.REGISTERED, header, source, {"job": spec.job})
            if header.kind is Kind.TEARDOWN:
                final = self.teardown(header.job)
                return _reply(Kind.TORN_DOWN, header, source, {"job": header.job, **final})
            if header.kind is Kind.STATS_REQUEST:
                return _reply(Kind.STATS, header, source, self.statistics())
            raise RequestRefused("unexpected_kind", f"{header.kind.name} is a reply, not a request")
        except RequestRefused as error:
            self.count(f"control_error_{error.code}")
            return _reply(Kind.ERROR, header, source, {"code": error.code, "message": str(error)})
        except SpecError as error:
            self.count("control_error_bad_spec")
            return _reply(Kind.ERROR, header, source, {"code": "bad_spec", "message": str(error)})

    def register(self, spec: JobSpec) -> Job:
        """Create a job; registering the same spec again is a no-op (control is retried)."""
        spec = self._resolved(spec)
        existing = self.jobs.get(spec.job)
        if existing is not None:
            if existing.spec == spec:
                return existing
            raise RequestRefused("job_exists", f"job {spec.job} is registered with another spec")
        refusal = self.profile.refuse(spec)
        if refusal:
            raise RequestRefused("unsupported", refusal)
        self._check_memory(spec)
        job = Job(spec, self.native)
        self.jobs[spec.job] = job
        if spec.parent is not None:
            self._children[(spec.parent.address, spec.parent.job)] = spec.job
        return job

    def teardown(self, job_id: int) -> dict:
        job = self.jobs.pop(job_id, None)
        if job is None:
            raise RequestRefused("unknown_job", f"job {job_id} is not registered")
        if job.spec.parent is not None:
            self._children.pop((job.spec.parent.address, job.spec.parent.job), None)
        return {"stats": dict(job.pool.stats)}

    def _check_memory(self, spec: JobSpec) -> None:
        need = slot_memory(spec)
        used = sum(slot_memory(j.spec) for j in self.jobs.values())
        if len(self.jobs) >= self.profile.max_jobs:
            raise RequestRefused("too_many_jobs", f"{self.profile.max_jobs} jobs already")
        if need > self.profile.job_memory or used + need > self.profile.total_memory:
            raise RequestRefused(
                "out_of_memory",
                f"job {spec.job} needs {need} bytes of slots; a job may use "
                f"{self.profile.job_memory}, {self.profile.total_memory - used} are free",
            )

    def _resolved(self, spec: JobSpec) -> JobSpec:
        addresses = tuple(self.resolve(a) for a in spec.addresses)
        parent = spec.parent
        if parent is not None:
            parent = type(parent)(self.resolve(parent.address), parent.job, parent.worker)
        return JobSpec(
            spec.job, addresses, spec.slots, spec.elements, spec.op, spec.max_contributors,
            spec.quorum, spec.deadline, parent, spec.group,
        )  # fmt: skip

    def native_pools(self) -> list:
        """The C cores of the native jobs, for the daemon's loop (``native_pool.serve``)."""
        return [job.pool.core for job in self.jobs.values() if job.native]

    def count(self, name: str, times: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + times

    def statistics(self) -> dict:
        return {
            "profile": self.profile.name,
            "aggregator": dict(self.stats),
            "jobs": {str(j): dict(job.pool.stats) for j, job in self.jobs.items()},
        }

    def _drop(self, reason: str, detail: str = "") -> Drop:
        self.count(f"dropped_{reason}")
        return Drop(reason, detail)


class RequestRefused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


_CONTROL = frozenset({Kind.REGISTER, Kind.TEARDOWN, Kind.STATS_REQUEST, Kind.REGISTERED,
                      Kind.TORN_DOWN, Kind.STATS, Kind.ERROR})  # fmt: skip


def _sum_op(spec: JobSpec):
    if isinstance(spec.op, IntegerSum):
        return IntegerSumOp(spec.op, spec.elements)
    if spec.op.kind == "float-sum":
        return FloatSumOp()
    try:
        return DecodeSumEncodeOp(spec.op, spec.max_contributors)
    except (ValueError, TypeError) as error:
        raise SpecError(f"op: {error}") from None


def _json_body(payload: memoryview) -> dict:
    try:
        body = json.loads(bytes(payload).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise RequestRefused("bad_request", f"body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestRefused("bad_request", "body must be a JSON object")
    return body


def _reply(kind: Kind, request: Header, source: Address, body: dict) -> Send:
    header = Header(kind, request.job, chunk=request.chunk).pack()
    return Send(actions.REPLY, (source,), header, json.dumps(body).encode())
