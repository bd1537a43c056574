"""What a job registration says: workers and their addresses, pool geometry, the combining op.

Specs are plain frozen data, checked on construction, and round-trip through the JSON body of a
REGISTER control message (``to_json`` / ``from_json``).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace

from ..codecs.lanes import IntegerOp, packed_nbytes
from .authentication import TAG_SIZE, data_token, packet_mac_key
from .packet import MAX_PAYLOAD, MAX_WORKERS

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
    token: int = 0  # the parent job's data token, carried on the partial sums sent up


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
    # The job's own key (authentication.py), agreed by its workers; not part of to_json: its
    # REGISTER carries it wrapped. None: a job any sender may tear down and read (protocol 1).
    key: bytes | None = field(default=None, repr=False)
    # "token": packets carry the job's data token (checked by equality); "mac": each packet
    # also ends in a keyed MAC of its header and payload (software aggregators, no parent)
    integrity: str = "token"

    def __post_init__(self):
        workers = len(self.addresses)
        for name in ("job", "slots", "elements", "max_contributors", "quorum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise SpecError(f"{name} must be an integer, got {value!r:.40}")
        object.__setattr__(self, "addresses", tuple(
            _ip_literal(a, f"addresses[{i}]") for i, a in enumerate(self.addresses)
        ))  # fmt: skip
        if self.group is not None:
            object.__setattr__(self, "group", _ip_literal(self.group, "group"))
        if self.parent is not None:
            address = _ip_literal(self.parent.address, "parent.address")
            object.__setattr__(self, "parent", replace(self.parent, address=address))
        _check_range("job", self.job, 0, 0xFFFF)
        _check_range("number of workers", workers, 1, MAX_WORKERS - 1)
        _check_range("slots", self.slots, 1, 1 << 20)
        _check_range("elements", self.elements, 1, 1 << 24)
        if len(set(self.addresses)) != workers:
            raise SpecError("worker addresses must be distinct")
        total = self.max_contributors or workers
        if total < workers:
            raise SpecError(f"max_contributors {total} is below the {workers} workers")
        _check_range("max_contributors", total, workers, MAX_WORKERS)
        object.__setattr__(self, "max_contributors", total)
        self._check_packets()
        if self.quorum:
            _check_range("quorum", self.quorum, 1, workers)
            if self.deadline <= 0:
                raise SpecError("a quorum needs a positive deadline")
        if self.parent is not None and not isinstance(self.op, IntegerSum):
            raise SpecError("only integer-sum jobs can forward to a parent switch")
        if self.group is not None:
            _check_group(self.group)
        if self.key is not None and (not isinstance(self.key, bytes) or len(self.key) != 32):
            raise SpecError("key must be 32 bytes")
        if self.integrity not in ("token", "mac"):
            raise SpecError(f"integrity must be 'token' or 'mac', got {self.integrity!r:.20}")
        if self.integrity == "mac" and (self.key is None or self.parent is not None):
            raise SpecError("integrity 'mac' needs a key, and a job without a parent")
        self._check_width(total)

    def _check_packets(self) -> None:
        """A packet of ``elements`` lanes must fit one datagram, or no chunk could be sent."""
        if isinstance(self.op, IntegerSum):
            bits = max(self.op.in_bits, self.op.out_bits)
        elif isinstance(self.op, FloatSum):
            bits = 32
        else:
            return  # decode-sum-encode: elements counts coordinates, not lanes
        room = MAX_PAYLOAD - (TAG_SIZE if self.integrity == "mac" else 0)
        if packed_nbytes(self.elements, bits) > room:
            raise SpecError(
                f"elements {self.elements} of {bits} bits are "
                f"{packed_nbytes(self.elements, bits)} bytes, more than one packet carries "
                f"({room})"
            )

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

    @property
    def mac_key(self) -> bytes | None:
        """The per-packet MAC key of an integrity-"mac" job (None: no MACs)."""
        return packet_mac_key(self.key) if self.integrity == "mac" else None

    @property
    def token(self) -> int:
        """The data token every packet of the job carries (0 for a job without a key)."""
        return 0 if self.key is None else data_token(self.key)

    def to_json(self) -> dict:
        parent = None
        if self.parent is not None:
            host, port = self.parent.address
            parent = {"address": f"{host}:{port}", "job": self.parent.job}
            parent["worker"] = self.parent.worker
            if self.parent.token:
                parent["token"] = self.parent.token
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
            "integrity": self.integrity,
        }

    @classmethod
    def from_json(cls, body: object, key: bytes | None = None) -> JobSpec:
        """A spec from a REGISTER body, checked field by field: every field of the right type
        and range, no unknown field, addresses as IP literals (the aggregator resolves no
        names). ``key``: the job's key, which travels apart (wrapped). ``SpecError`` names the
        field."""
        if not isinstance(body, dict):
            raise SpecError("a registration body is a JSON object")
        _known(body, _SPEC_FIELDS, "")
        addresses = _list(body, "addresses")
        parent = body.get("parent")
        group = body.get("group")
        try:
            return cls(
                job=_int(body, "job"),
                addresses=tuple(
                    parse_ip_address(a, f"addresses[{i}]") for i, a in enumerate(addresses)
                ),
                slots=_int(body, "slots"),
                elements=_int(body, "elements"),
                op=op_from_json(body.get("op")),
                max_contributors=_int(body, "max_contributors", 0),
                quorum=_int(body, "quorum", 0),
                deadline=_number(body, "deadline", 0.0, 0.0, 3600.0),
                parent=None if parent is None else _parent(parent),
                group=None if group is None else parse_ip_address(group, "group"),
                integrity=body.get("integrity", "token"),
                key=key,
            )
        except (TypeError, ValueError) as error:
            if isinstance(error, SpecError):
                raise
            raise SpecError(str(error)) from None


_SPEC_FIELDS = frozenset(
    {"job", "addresses", "slots", "elements", "op", "max_contributors", "quorum", "deadline",
     "parent", "group", "integrity"}
)  # fmt: skip
_OP_FIELDS = {
    "integer-sum": frozenset({"kind", "in_bits", "out_bits", "signed", "table"}),
    "float-sum": frozenset({"kind"}),
    "decode-sum-encode": frozenset({"kind", "codec", "options", "seed"}),
}


def op_from_json(body: object) -> OpSpec:
    if not isinstance(body, dict):
        raise SpecError("op must be an object with a 'kind'")
    kind = body.get("kind")
    if not isinstance(kind, str) or kind not in _OP_FIELDS:
        raise SpecError(f"op.kind must be one of {sorted(_OP_FIELDS)}, got {kind!r}")
    _known(body, _OP_FIELDS[kind], "op.")
    if kind == IntegerSum.kind:
        table = body.get("table")
        if table is not None:
            if not isinstance(table, list):
                raise SpecError("op.table must be a list of integers or null")
            for i, value in enumerate(table):
                if isinstance(value, bool) or not isinstance(value, int):
                    raise SpecError(f"op.table[{i}] must be an integer, got {value!r}")
                _check_range(f"op.table[{i}]", value, 0, (1 << 31) - 1)
        signed = body.get("signed", False)
        if not isinstance(signed, bool):
            raise SpecError(f"op.signed must be true or false, got {signed!r}")
        return IntegerSum(
            _int(body, "in_bits", where="op."),
            _int(body, "out_bits", where="op."),
            signed,
            None if table is None else tuple(table),
        )
    if kind == FloatSum.kind:
        return FloatSum()
    codec, options = body.get("codec"), body.get("options") or {}
    if not isinstance(codec, str) or not codec:
        raise SpecError(f"op.codec must be a codec name, got {codec!r}")
    if not isinstance(options, dict):
        raise SpecError("op.options must be an object")
    for name, value in options.items():
        if not (value is None or isinstance(value, (bool, int, float, str))):
            raise SpecError(f"op.options.{name} must be a number, string, boolean or null")
    seed = _int(body, "seed", 0, where="op.")
    _check_range("op.seed", seed, 0, (1 << 63) - 1)
    return DecodeSumEncode(codec, options, seed)


def parse_address(text: object) -> Address:
    """``"HOST:PORT"`` -> (host, port); IPv6 hosts in brackets."""
    if not isinstance(text, str) or ":" not in text:
        raise SpecError(f"address {text!r} is not HOST:PORT")
    host, _, port = text.rpartition(":")
    if host.startswith("["):  # an IPv6 host, whole in its brackets: "[::1]:5", never "[::1:5"
        if not host.endswith("]") or "[" in host[1:-1] or "]" in host[1:-1]:
            raise SpecError(f"address {text!r} is not [IPV6]:PORT (a bracket is unmatched)")
        host = host[1:-1]
    elif "[" in host or "]" in host or ":" in host:
        raise SpecError(f"address {text!r} is not HOST:PORT (an IPv6 host goes in brackets)")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SpecError(f"address {text!r} is not HOST:PORT with a port in 0..65535")
    return host, int(port)


def parse_ip_address(text: object, field: str = "address") -> Address:
    """``"IP:PORT"`` with an IP literal (IPv6 in brackets) -> (normalized ip, port 1..65535),
    as ``recvfrom`` reports sources; names are refused (clients resolve them)."""
    if not isinstance(text, str) or len(text) > 64:
        raise SpecError(f"{field} must be an \"IP:PORT\" string, got {text!r:.80}")
    try:
        address = parse_address(text)
    except SpecError as error:
        raise SpecError(f"{field}: {error}") from None
    return _ip_literal(address, field)


def _ip_literal(address: object, field: str) -> Address:
    """(ip, port) with the IP normalized, as sockets report sources; names are refused."""
    if not isinstance(address, tuple) or len(address) != 2:
        raise SpecError(f"{field} must be an (IP, port) pair, got {address!r:.80}")
    host, port = address
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise SpecError(f"{field} needs a port in 1..65535, got {port!r:.20}")
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        message = f"{field} {host!r:.80} is not an IP literal (clients resolve names)"
        raise SpecError(message) from None


def _parent(body: object) -> ParentLink:
    if not isinstance(body, dict):
        raise SpecError("parent must be an object")
    _known(body, frozenset({"address", "job", "worker", "token"}), "parent.")
    link = ParentLink(
        parse_ip_address(body.get("address"), "parent.address"),
        _int(body, "job", where="parent."),
        _int(body, "worker", where="parent."),
        _int(body, "token", 0, where="parent."),
    )
    _check_range("parent.token", link.token, 0, (1 << 64) - 1)
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


def _int(body: dict, key: str, default: int | None = None, where: str = "") -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{where}{key} must be an integer, got {value!r:.40}")
    return value


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{key} must be a number, got {value!r:.40}")
    if not low <= value <= high:
        raise SpecError(f"{key} must be in {low:g}..{high:g}, got {value!r:.40}")
    return float(value)


def _known(body: dict, fields: frozenset, where: str) -> None:
    unknown = sorted(str(k) for k in body if k not in fields)
    if unknown:
        raise SpecError(f"unknown field {where}{unknown[0]:.40}")


def _list(body: dict, key: str) -> list:
    value = body.get(key)
    if not isinstance(value, list):
        raise SpecError(f"{key} must be a list")
    if len(value) >= MAX_WORKERS:
        raise SpecError(f"{key} holds {len(value)} entries, at most {MAX_WORKERS - 1}")
    return value


def _check_range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise SpecError(f"{name} must be in {low}..{high}, got {value}")
