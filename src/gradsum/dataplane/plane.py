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
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from . import actions, authentication, bounded_json, native_pool
from .actions import Drop, Send
from .combiners import DecodeSumEncodeOp, FloatSumOp, IntegerSumOp
from .jobspec import Address, IntegerSum, JobSpec, SpecError
from .native_pool import NativePool
from .packet import (
    HEADER_SIZE,
    MAX_DATAGRAM,
    SIGNED,
    Header,
    Kind,
    MalformedPacket,
    parse_header,
)
from .slots import SlotPool

STATS_PAGE_JOBS = 16  # jobs per STATS reply: ~1 KiB each, so a page stays far below a datagram
KEPT_TEARDOWNS = 256  # torn-down jobs whose final counters a retried TEARDOWN gets again


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
    tenant_jobs: int = 256  # jobs one admission secret (or, without secrets, everyone) may hold
    tenant_memory: int | None = None  # bytes one admission secret may hold (None: total_memory)

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
    job_memory: int = 256 << 20, total_memory: int = 1 << 30, max_elements: int = 1 << 24,
    **limits,
) -> Profile:  # fmt: skip
    return Profile("switch", True, job_memory, total_memory, max_elements=max_elements, **limits)


def server_profile(
    job_memory: int = 1 << 30, total_memory: int = 4 << 30, max_elements: int = 1 << 24,
    **limits,
) -> Profile:  # fmt: skip
    return Profile("server", False, job_memory, total_memory, max_elements=max_elements, **limits)


def pool_type(spec: JobSpec, native: bool = True):
    """The slot pool that serves ``spec``: C where it can (``native_pool.serves``)."""
    return NativePool if native and native_pool.serves(spec) else SlotPool


def slot_memory(spec: JobSpec, native: bool = True) -> int:
    """Bytes the job's slot pool holds (what admission counts against the limits)."""
    return pool_type(spec, native).memory(spec)


class Job:
    def __init__(self, spec: JobSpec, native: bool = True, tenant: str = ""):
        self.spec = spec
        self.tenant = tenant  # who registered it: an admission secret's name ("" without any)
        self.native = pool_type(spec, native) is NativePool
        self.memory = slot_memory(spec, native)
        self.pool = NativePool(spec) if self.native else SlotPool(spec, _sum_op(spec))


class DataPlane:
    def __init__(
        self,
        profile: Profile,
        native: bool = True,
        secrets: dict[str, bytes] | None = None,
        wall: Callable[[], float] = time.time,
    ):
        self.profile = profile
        self.native = native  # integer jobs' pools in C where they can be (native_pool)
        # Admission secrets by name (authentication.py): who may register jobs. Without any,
        # anyone may (protocol 1's trust), and a job's key still guards its teardown and stats.
        self.secrets = dict(secrets or {})
        self.wall = wall  # the clock signed timestamps are checked against
        self.port = 0  # the UDP port it serves, bound into signatures (the daemon sets it)
        self.replays = authentication.ReplayGuard()
        self.jobs: dict[int, Job] = {}
        self._children: dict[tuple[Address, int], int] = {}  # (parent, parent job) -> our job
        self._torn_down: OrderedDict[int, tuple[Job, dict]] = OrderedDict()
        self.stats: dict[str, int] = {}

    # -- the one entry point for packets ----------------------------------------------------
    def on_datagram(self, data: memoryview, source: Address, now: float) -> list:
        """What to do with one datagram. Nothing that arrives raises past here: a packet that
        breaks a handler is dropped and counted (``dropped_internal_error``), and the job and
        every other job go on."""
        try:
            return self._on_datagram(data, source, now)
        except Exception as error:  # the serving loop's one guarantee
            return [self._drop("internal_error", f"{type(error).__name__}: {error}"[:200])]

    def _on_datagram(self, data: memoryview, source: Address, now: float) -> list:
        self.count("datagrams")
        try:
            header = parse_header(data)
        except MalformedPacket as error:
            drop = self._drop(error.reason, str(error))
            if error.reason in _ANSWERED and len(data) >= HEADER_SIZE and data[3] in _CONTROL:
                # a control request still gets an ERROR naming what is wrong with its header
                job = int.from_bytes(data[4:6], "little")
                request = Header(Kind.ERROR, job, chunk=int.from_bytes(data[16:24], "little"))
                return [drop, self._error(request, source, error.reason, str(error), len(data))]
            return [drop]
        payload = data[HEADER_SIZE:]
        if header.kind is Kind.DATA:
            return self._on_data(header, payload, source, now)
        if header.kind is Kind.RESULT:
            return self._on_parent_result(header, payload, source)
        if header.kind in _CONTROL:
            return [self._on_control(header, data, source)]
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
                try:
                    done += job.pool.on_tick(now)
                except Exception as error:  # as on_datagram
                    done.append(self._drop("internal_error", f"{type(error).__name__}"))
        return done

    def next_deadline(self) -> float | None:
        deadlines = [j.pool.next_deadline() for j in self.jobs.values() if j.spec.quorum]
        return min((d for d in deadlines if d is not None), default=None)

    # -- control ----------------------------------------------------------------------------
    def _on_control(self, header: Header, data: memoryview, source: Address) -> Send:
        """A control request's reply. A signed request (flag SIGNED) is verified under an
        admission secret or its job's key, and answered signed with that key; an unsigned
        one gets a reply no larger than itself, so a spoofed source gains no amplification."""
        self.count(f"control_{header.kind.name.lower()}")
        raw, limit, key = bytes(data), len(data), None
        try:
            principal = None
            if header.flags & SIGNED:
                principal = self._authenticate(header, raw)
                key, limit = principal[2], MAX_DATAGRAM
                raw = raw[: -authentication.TRAILER_SIZE]
            payload = memoryview(raw)[HEADER_SIZE:]
            kind, body = self._control(header, payload, principal)
            return self._reply(kind, header, source, body, limit, key)
        except RequestRefused as error:
            if error.key is not None:  # the signature verified: the refusal is signed too
                key, limit = error.key, MAX_DATAGRAM
            return self._error(header, source, error.code, str(error), limit, key)
        except SpecError as error:
            return self._error(header, source, "bad_spec", str(error), limit, key)
        except Exception as error:  # never past the serving loop
            return self._error(header, source, "internal_error", type(error).__name__, limit, key)

    def _authenticate(self, header: Header, raw: bytes) -> tuple[str, str, bytes]:
        """(what, who, key) whose key signed ``raw``: ("secret", name, secret) or ("job", id,
        key); refused if none did, or if the message is not fresh."""
        parts = authentication.split(raw)
        if parts is None or len(parts[0]) < HEADER_SIZE:
            raise RequestRefused("unauthenticated", "a signed request needs its trailer")
        _, stamp, nonce, _ = parts
        candidates = [("secret", name, secret) for name, secret in self.secrets.items()]
        job = self._job_or_record(header.job)
        if job is not None and job.spec.key is not None:
            candidates.append(("job", str(header.job), job.spec.key))
        for principal in candidates:
            if authentication.verifies(raw, principal[2], self.port):
                refusal = self.replays.check(stamp, nonce, self.wall(), principal[2])
                if refusal:
                    raise RequestRefused("replayed", refusal, key=principal[2])
                return principal
        if (job is None and header.kind is Kind.TEARDOWN) or (
            job is None and header.kind is Kind.STATS_REQUEST and header.job != 0
        ):
            # A request for a job is signed with its key, which went with the job: say that
            # the job is gone (an aggregator that restarted), not that the signer is a stranger.
            raise RequestRefused("unknown_job", f"job {header.job} is not registered")
        raise RequestRefused("unauthenticated", "no admission secret or job key signed this")

    def _control(self, header: Header, payload: memoryview, principal) -> tuple[Kind, dict]:
        if header.kind is Kind.REGISTER:
            if self.secrets and (principal is None or principal[0] != "secret"):
                # checked before the body is parsed: a stranger's request costs no parsing
                raise RequestRefused("unauthenticated", "registering needs an admission secret")
            body = _json_body(payload)
            key = _job_key(body.pop("key", None), principal)
            spec = JobSpec.from_json(body, key)
            if spec.job != header.job:
                raise SpecError(f"header job {header.job} != body job {spec.job}")
            tenant = principal[1] if principal and principal[0] == "secret" else ""
            self.register(spec, tenant)
            return Kind.REGISTERED, {"job": spec.job}
        if header.kind is Kind.TEARDOWN:
            self._authorize(header.job, principal)
            return Kind.TORN_DOWN, {"job": header.job, **self.teardown(header.job)}
        if header.kind is Kind.STATS_REQUEST:
            body = _json_body(payload) if payload.tobytes().strip() else {}
            return Kind.STATS, self._stats_reply(body, principal)
        raise RequestRefused("unexpected_kind", f"{header.kind.name} is a reply, not a request")

    def _authorize(self, job_id: int, principal) -> None:
        """A job's teardown and statistics: its key, or the admission secret that registered
        it; anyone for a job without a key on an aggregator without secrets (protocol 1)."""
        job = self._job_or_record(job_id)
        if job is None:
            raise RequestRefused("unknown_job", f"job {job_id} is not registered")
        if job.spec.key is None and not self.secrets:
            return
        if principal is None:
            raise RequestRefused("unauthenticated", f"job {job_id} needs a request signed with "
                                 "its key or the secret that registered it")  # fmt: skip
        if (principal[0] == "job" and principal[1] == str(job_id)) or (
            principal[0] == "secret" and principal[1] == job.tenant
        ):
            return
        raise RequestRefused("forbidden", f"job {job_id} belongs to another principal")

    def _job_or_record(self, job_id: int) -> Job | None:
        job = self.jobs.get(job_id)
        if job is None and job_id in self._torn_down:
            job = self._torn_down[job_id][0]
        return job

    def _reply(self, kind: Kind, request: Header, source: Address, body: dict, limit: int,
               key: bytes | None) -> Send:  # fmt: skip
        """The reply datagram: signed under ``key``, or at most ``limit`` bytes."""
        flags = SIGNED if key is not None else 0
        header = Header(kind, request.job, flags=flags, chunk=request.chunk).pack()
        payload = json.dumps(body).encode()
        if key is not None:
            signed = authentication.sign(header + payload, key, self.wall(), self.port)
            return Send(actions.REPLY, (source,), signed[:HEADER_SIZE], signed[HEADER_SIZE:])
        if HEADER_SIZE + len(payload) > limit:
            if kind is not Kind.ERROR:  # the requester pads its request to make room
                need = HEADER_SIZE + len(payload)
                self.count("control_error_reply_too_large")
                body = {"code": "reply_too_large", "need": need}
                kind = Kind.ERROR
                header = Header(kind, request.job, chunk=request.chunk).pack()
            for smaller in (body, {"code": body.get("code")}):
                payload = json.dumps(smaller).encode()
                if HEADER_SIZE + len(payload) <= limit:
                    break
            else:
                payload = b""
        return Send(actions.REPLY, (source,), header, payload)

    def _error(self, header: Header, source: Address, code: str, message: str, limit: int,
               key: bytes | None = None) -> Send:  # fmt: skip
        self.count(f"control_error_{code}")
        body = {"code": code, "message": message[:400]}
        return self._reply(Kind.ERROR, header, source, body, limit, key)

    def register(self, spec: JobSpec, tenant: str = "") -> Job:
        """Create a job; registering the same spec again is a no-op (control is retried)."""
        existing = self.jobs.get(spec.job)
        if existing is not None:
            if existing.spec == spec and existing.tenant == tenant:
                return existing
            raise RequestRefused("job_exists", f"job {spec.job} is registered with another spec")
        refusal = self.profile.refuse(spec)
        if refusal:
            raise RequestRefused("unsupported", refusal)
        self._admit(spec, tenant)
        job = Job(spec, self.native, tenant)
        self.jobs[spec.job] = job
        self._torn_down.pop(spec.job, None)
        if spec.parent is not None:
            self._children[(spec.parent.address, spec.parent.job)] = spec.job
        return job

    def teardown(self, job_id: int) -> dict:
        """Remove a job; its final counters come back, again for a retried TEARDOWN."""
        job = self.jobs.pop(job_id, None)
        if job is None:
            if job_id in self._torn_down:
                return {"stats": self._torn_down[job_id][1]}
            raise RequestRefused("unknown_job", f"job {job_id} is not registered")
        if job.spec.parent is not None:
            self._children.pop((job.spec.parent.address, job.spec.parent.job), None)
        final = dict(job.pool.stats)
        job.pool = None  # the slots go now; the record keeps spec, owner and counters
        self._torn_down[job_id] = (job, final)
        while len(self._torn_down) > KEPT_TEARDOWNS:
            self._torn_down.popitem(last=False)
        return {"stats": final}

    def _admit(self, spec: JobSpec, tenant: str) -> None:
        """Refuse a job past the limits: jobs and memory in all, and per admission secret."""
        profile = self.profile
        need = slot_memory(spec, self.native)
        used = sum(j.memory for j in self.jobs.values())
        own = [j for j in self.jobs.values() if j.tenant == tenant]
        own_used = sum(j.memory for j in own)
        own_limit = profile.total_memory if profile.tenant_memory is None else profile.tenant_memory
        if len(self.jobs) >= profile.max_jobs:
            raise RequestRefused("too_many_jobs", f"{profile.max_jobs} jobs already")
        if len(own) >= profile.tenant_jobs:
            raise RequestRefused("too_many_jobs", f"{profile.tenant_jobs} jobs of yours already")
        free = min(profile.total_memory - used, own_limit - own_used)
        if need > profile.job_memory or need > free:
            raise RequestRefused(
                "out_of_memory",
                f"job {spec.job} needs {need} bytes of slots; a job may use "
                f"{profile.job_memory}, {max(0, free)} are free",
            )

    def _stats_reply(self, body: dict, principal=None) -> dict:
        """One page of STATS: the aggregator's counters and up to ``STATS_PAGE_JOBS`` jobs
        (by id, from ``page``), or one job's counters (``{"job": id}``). With admission
        secrets, the aggregator's page needs one, and shows that secret's jobs only."""
        _known(body, {"page", "job"})
        if "job" in body:
            job_id = _field_int(body, "job", 0, 0xFFFF)
            self._authorize(job_id, principal)
            job = self.jobs.get(job_id)
            if job is None:
                raise RequestRefused("unknown_job", f"job {job_id} is not registered")
            return {"profile": self.profile.name, "job": job_id, "stats": dict(job.pool.stats)}
        if self.secrets and (principal is None or principal[0] != "secret"):
            raise RequestRefused("unauthenticated", "aggregator statistics need a secret")
        page = _field_int(body, "page", 0, 0xFFFF) if "page" in body else 0
        tenant = principal[1] if self.secrets else None
        ids = sorted(j for j, job in self.jobs.items() if tenant is None or job.tenant == tenant)
        pages = max(1, -(-len(ids) // STATS_PAGE_JOBS))
        shown = ids[page * STATS_PAGE_JOBS : (page + 1) * STATS_PAGE_JOBS]
        return {
            "profile": self.profile.name,
            "aggregator": dict(self.stats),
            "jobs": {str(j): dict(self.jobs[j].pool.stats) for j in shown},
            "page": page,
            "pages": pages,
            "memory": self.memory_usage(),
        }

    def native_pools(self) -> list:
        """The C cores of the native jobs, for the daemon's loop (``native_pool.serve``)."""
        return [job.pool.core for job in self.jobs.values() if job.native]

    def count(self, name: str, times: int = 1) -> None:
        self.stats[name] = self.stats.get(name, 0) + times

    def statistics(self) -> dict:
        """Every counter of the aggregator and all jobs (the daemon's own reports; over the
        wire, STATS comes in pages)."""
        return {
            "profile": self.profile.name,
            "aggregator": dict(self.stats),
            "jobs": {str(j): dict(job.pool.stats) for j, job in self.jobs.items()},
        }

    def memory_usage(self) -> dict:
        """Slot memory held (bytes, as admission counts it) and the limit of all jobs."""
        return {"used": sum(j.memory for j in self.jobs.values()),
                "limit": self.profile.total_memory}  # fmt: skip

    def _drop(self, reason: str, detail: str = "") -> Drop:
        self.count(f"dropped_{reason}")
        return Drop(reason, detail)


class RequestRefused(Exception):
    """A control request refused with ERROR ``code``; ``key``: the principal whose signature
    verified, which signs the refusal (else it goes unsigned)."""

    def __init__(self, code: str, message: str, key: bytes | None = None):
        super().__init__(message)
        self.code, self.key = code, key


_ANSWERED = frozenset({"reserved_bits", "bad_protocol"})  # header faults a control request hears of
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


def _job_key(field: object, principal) -> bytes | None:
    """The job key of a REGISTER body: ``{"nonce", "wrapped"}`` under the admission secret
    that signed it, or ``{"clear"}`` (an aggregator without secrets); hex strings."""
    if field is None:
        return None
    if not isinstance(field, dict):
        raise SpecError("key must be an object")
    try:
        if set(field) == {"clear"}:
            key = bytes.fromhex(field["clear"])
        elif set(field) == {"nonce", "wrapped"}:
            if principal is None or principal[0] != "secret":
                raise SpecError("key: a wrapped key needs a request signed by an admission secret")
            nonce, wrapped = bytes.fromhex(field["nonce"]), bytes.fromhex(field["wrapped"])
            if len(nonce) != 16 or len(wrapped) != authentication.KEY_SIZE:
                raise SpecError("key: nonce of 16 bytes and a wrapped key of 32")
            key = authentication.wrap_key(wrapped, principal[2], nonce)
        else:
            raise SpecError("key must hold 'clear', or 'nonce' and 'wrapped'")
    except (TypeError, ValueError) as error:
        if isinstance(error, SpecError):
            raise
        raise SpecError(f"key: {error}") from None
    if len(key) != authentication.KEY_SIZE:
        raise SpecError("key must be 32 bytes")
    return key


def _json_body(payload: memoryview) -> dict:
    try:
        body = bounded_json.loads(payload)
    except bounded_json.JsonRefused as error:
        raise RequestRefused("bad_request", str(error)) from None
    if not isinstance(body, dict):
        raise RequestRefused("bad_request", "body must be a JSON object")
    return body


def _known(body: dict, fields: set) -> None:
    unknown = sorted(str(k) for k in body if k not in fields)
    if unknown:
        raise RequestRefused("bad_request", f"unknown field {unknown[0]!r:.40}")


def _field_int(body: dict, key: str, low: int, high: int) -> int:
    value = body.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestRefused("bad_request", f"{key} must be an integer in {low}..{high}")
    return value


