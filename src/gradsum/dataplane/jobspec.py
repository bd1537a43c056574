"""What a job registration says: workers and their addresses, pool geometry, the combining op.

Specs are plain frozen data, checked on construction, and round-trip through the JSON body of a
REGISTER control message (``to_json`` / ``from_json``).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from ..codecs.lanes import IntegerOp
from .packet import MAX_WORKERS

Address = tuple[str, int]


class SpecError(ValueError):
    """A job registration that cannot be served; the message names the field."""


@dataclass(frozen=True)
class IntegerSum:
    """Sum integers: lanes of ``in_bits`` (looked up in ``table`` when given), results of
    ``out_bits``. Runs on a switch. bfp: 32/32 signed; THC: b-bit indices, table, sum width."""

    in_bits: int
    out_bits: int
    signed: bool = False
    table: tuple[int, ...] | None = None
    kind = "integer-sum"

    def __post_init__(self):
        if self.signed:
            if (self.in_bits, self.out_bits, self.table) != (32, 32, None):
                raise SpecError("signed integer-sum is int32 lanes to int32 sums, without a table")
            return
        if not 1 <= self.in_bits <= 16:
            raise SpecError(f"op.in_bits must be 1..16 for unsigned lanes, got {self.in_bits}")
        if not 1 <= self.out_bits <= 31:
            raise SpecError(f"op.out_bits must be 1..31 for unsigned sums, got {self.out_bits}")
        if self.table is not None:
            table = self.table
            if len(table) != 1 << self.in_bits or min(table) < 0:
                raise SpecError(
                    f"op.table must hold 2**in_bits = {1 << self.in_bits} non-negative integers"
                )
            object.__setattr__(self, "table", tuple(int(v) for v in table))

    @classmethod
    def from_integer_op(cls, op: IntegerOp) -> IntegerSum:
        return cls(op.in_bits, op.out_bits, op.signed, op.table)

    def max_lane(self) -> int | None:
        """Largest value one contribution adds per lane (None: signed, bounded by the codec)."""
        if self.signed:
            return None
        return max(self.table) if self.table is not None else (1 << self.in_bits) - 1

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "in_bits": self.in_bits,
            "out_bits": self.out_bits,
            "signed": self.signed,
            "table": None if self.table is None else list(self.table),
        }


@dataclass(frozen=True)
class FloatSum:
    """Sum float32 lanes in worker order (deterministic); parameter servers only."""

    kind = "float-sum"

    def to_json(self) -> dict:
        return {"kind": self.kind}


@dataclass(frozen=True)
class DecodeSumEncode:
    """Reassemble each worker's whole payload of a partition, then ``codec.aggregate``."""

    codec: str
    options: dict = field(default_factory=dict)
    seed: int = 0
    kind = "decode-sum-encode"

    def to_json(self) -> dict:
        return {"kind": self.kind, "codec": self.codec, "options": self.options, "seed": self.seed}


OpSpec = IntegerSum | FloatSum | DecodeSumEncode


@dataclass(frozen=True)
class ParentLink:
    """Where a switch forwards its partial sums: it is worker ``worker`` of job ``job`` there."""

    address: Address
    job: int
    worker: int


@dataclass(frozen=True)
class JobSpec:
    job: int
    addresses: tuple[Address, ...]  # worker i sends from addresses[i]
    slots: int
    elements: int  # lanes per slot (and per packet at most)
    op: OpSpec
    max_contributors: int = 0  # workers summed at the top of a hierarchy; 0: len(addresses)
    quorum: int = 0  # partial aggregation: complete at the deadline once this many arrived
    deadline: float = 0.0  # seconds after a slot's first arrival
    parent: ParentLink | None = None
    group: Address | None = None  # results multicast to this IP group (workers joined it)

    def __post_init__(self):
        workers = len(self.addresses)
        _check_range("job", self.job, 0, 0xFFFF)
        _check_range("number of workers", workers, 1, MAX_WORKERS - 1)
        _check_range("slots", self.slots, 1, 1 << 20)
        _check_range("elements", self.elements, 1, 1 << 24)
        if len(set(self.addresses)) != workers:
            raise SpecError("worker addresses must be distinct")
        total = self.max_contributors or workers
        if total < workers:
            raise SpecError(f"max_contributors {total} is below the {workers} workers")
        object.__setattr__(self, "max_contributors", total)
        if self.quorum:
            _check_range("quorum", self.quorum, 1, workers)
            if self.deadline <= 0:
                raise SpecError("a quorum needs a positive deadline")
        if self.parent is not None and not isinstance(self.op, IntegerSum):
            raise SpecError("only integer-sum jobs can forward to a parent switch")
        if self.group is not None:
            _check_group(self.group)
        self._check_width(total)

    def _check_width(self, total: int) -> None:
        if not isinstance(self.op, IntegerSum):
            return
        most = self.op.max_lane()
        if most is not None and most * total >= 1 << self.op.out_bits:
            raise SpecError(
                f"sums of {total} contributions of up to {most} need more than "
                f"op.out_bits = {self.op.out_bits} bits"
            )

    @property
    def workers(self) -> int:
        return len(self.addresses)

    def to_json(self) -> dict:
        parent = None
        if self.parent is not None:
            host, port = self.parent.address
            parent = {"address": f"{host}:{port}", "job": self.parent.job}
            parent["worker"] = self.parent.worker
        return {
            "job": self.job,
            "addresses": [f"{host}:{port}" for host, port in self.addresses],
            "slots": self.slots,
            "elements": self.elements,
            "op": self.op.to_json(),
            "max_contributors": self.max_contributors,
            "quorum": self.quorum,
            "deadline": self.deadline,
            "parent": parent,
            "group": None if self.group is None else f"{self.group[0]}:{self.group[1]}",
        }

    @classmethod
    def from_json(cls, body: dict) -> JobSpec:
        if not isinstance(body, dict):
            raise SpecError("a registration body is a JSON object")
        try:
            parent = body.get("parent")
            return cls(
                job=_int(body, "job"),
                addresses=tuple(parse_address(a) for a in _list(body, "addresses")),
                slots=_int(body, "slots"),
                elements=_int(body, "elements"),
                op=op_from_json(body.get("op")),
                max_contributors=_int(body, "max_contributors", 0),
                quorum=_int(body, "quorum", 0),
                deadline=float(body.get("deadline", 0.0)),
                parent=None if parent is None else _parent(parent),
                group=None if body.get("group") is None else parse_address(body["group"]),
            )
        except (TypeError, ValueError) as error:
            if isinstance(error, SpecError):
                raise
            raise SpecError(str(error)) from None


def op_from_json(body: object) -> OpSpec:
    if not isinstance(body, dict):
        raise SpecError("op must be an object with a 'kind'")
    kind = body.get("kind")
    if kind == IntegerSum.kind:
        table = body.get("table")
        return IntegerSum(
            _int(body, "in_bits"),
            _int(body, "out_bits"),
            bool(body.get("signed", False)),
            None if table is None else tuple(int(v) for v in table),
        )
    if kind == FloatSum.kind:
        return FloatSum()
    if kind == DecodeSumEncode.kind:
        options = body.get("options") or {}
        if not isinstance(options, dict):
            raise SpecError("op.options must be an object")
        return DecodeSumEncode(str(body.get("codec")), options, _int(body, "seed", 0))
    raise SpecError(f"unknown op kind {kind!r}")


def parse_address(text: object) -> Address:
    """``"HOST:PORT"`` -> (host, port); IPv6 hosts in brackets."""
    if not isinstance(text, str) or ":" not in text:
        raise SpecError(f"address {text!r} is not HOST:PORT")
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SpecError(f"address {text!r} is not HOST:PORT with a port in 0..65535")
    return host, int(port)


def _parent(body: object) -> ParentLink:
    if not isinstance(body, dict):
        raise SpecError("parent must be an object")
    link = ParentLink(parse_address(body.get("address")), _int(body, "job"), _int(body, "worker"))
    _check_range("parent.job", link.job, 0, 0xFFFF)
    _check_range("parent.worker", link.worker, 0, MAX_WORKERS - 1)
    return link


def is_ipv4(host: str) -> bool:
    """A numeric IPv4 address (what the native paths and multicast groups take)."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return False
    return True


def _check_group(group: Address) -> None:
    host, port = group
    if not is_ipv4(host) or not ipaddress.IPv4Address(host).is_multicast or not 1 <= port <= 65535:
        raise SpecError(f"group {host}:{port} is not an IPv4 multicast address (224.0.0.0/4:PORT)")


def _int(body: dict, key: str, default: int | None = None) -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{key} must be an integer, got {value!r}")
    return value


def _list(body: dict, key: str) -> list:
    value = body.get(key)
    if not isinstance(value, list):
        raise SpecError(f"{key} must be a list")
    return value


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise SpecError(f"{name} must be in {low}..{high}, got {value}")
