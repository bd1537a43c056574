"""The testbed planner: a spec in, the exact namespaces, links, addresses and tc rules out.

Pure and deterministic; nothing here touches the system. ``TestbedPlan.commands()`` renders the
plan as the ``ip``/``tc`` command lines the executor (``shell``) runs in order.

Topology. Every host is a network namespace ``gradsum-<id>-<host>``; one more namespace,
``gradsum-<id>-tor``, holds a bridge ``br0`` that stands for the top-of-rack switch. Each worker
(``w0`` ...) and each parameter-server host (``ps0`` ...) has one NIC, ``eth0``, a veth whose peer
is a bridge port in the ToR namespace named after the host. Both ends of every veth carry the
link's shaping (rate, delay, loss), so each direction of each link is shaped on its own egress:

* worker to worker (Gloo) crosses two links, each at the configured rate;
* n workers pushing to a PS host share its one link (its incast is real);
* gradsum's software switch *is* the ToR: host ``switch`` runs in the ToR namespace, on the
  bridge's address, so each worker reaches it over its own link (one port per worker at the
  configured rate), and in-network aggregation is not throttled by a single NIC.

Every interface lives inside a testbed namespace; the host's own namespace gets nothing, so
deleting the namespaces removes exactly what ``up`` made.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field

from .units import format_duration, format_rate

PREFIX = "gradsum"
TOR = "tor"
SWITCH = "switch"
BRIDGE = "br0"
NIC = "eth0"
SUBNET_BITS = 16
SWITCH_ADDRESS = "10.77.0.1"
_WORKER_NET = "10.77.1"
_PS_NET = "10.77.2"
MAX_HOSTS_PER_KIND = 254
ID_PATTERN = re.compile(r"[a-z0-9]{1,16}")

# htb: a bucket of at least one 64 KiB GSO super-packet, or 1 ms of line rate where that is more.
_MIN_BURST_BYTES = 64 * 1024
_BURST_SECONDS = 1e-3
_QUANTUM = 65536
# The rate of the htb class of a link that is lossy or delayed but not rate-limited.
UNSHAPED_RATE = 100 * 10**9
_FRAME_BYTES = 1514
# Jumbo frames on every testbed link, as datacenter fabrics run them: a 64 KiB gradsum datagram
# crosses a link as 8 IP fragments instead of 45 (each fragment costs the sender a trip through
# the bridge and the qdiscs in its own system call).
MTU = 9000
_NETEM_MIN_LIMIT = 1000
# Classic BPF: load a random u32 (SKF_AD_OFF + SKF_AD_RANDOM), match when it is below a threshold.
_BPF_RANDOM = 0xFFFFF000 + 56


@dataclass(frozen=True)
class TestbedSpec:
    """What the user asked for. ``rate`` in bit/s (None: unshaped); ``delay`` is one-way per link
    and direction in seconds; ``loss`` a fraction per link and direction; ``queue`` how many
    seconds of line rate each link's queue holds before it drops."""

    __test__ = False  # not a pytest test class

    id: str = "0"
    workers: int = 2
    switch: bool = False
    ps: int = 0
    rate: int | None = None
    delay: float = 0.0
    loss: float = 0.0
    queue: float = 0.02

    def __post_init__(self) -> None:
        if not ID_PATTERN.fullmatch(self.id):
            raise ValueError(f"testbed id {self.id!r} must be 1-16 lowercase letters or digits")
        _check_count("workers", self.workers, minimum=1)
        _check_count("ps", self.ps, minimum=0)
        if self.rate is not None and self.rate < 8_000:
            raise ValueError(f"rate {self.rate} bit/s is below 8kbit")
        if not 0 <= self.delay <= 10:
            raise ValueError(f"delay {self.delay} s must be between 0 and 10 s")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss {self.loss} must be a fraction in [0, 1)")
        if not 0 < self.queue <= 10:
            raise ValueError(f"queue {self.queue} s must be above 0 and at most 10 s")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TestbedSpec:
        return cls(**json.loads(text))


def _check_count(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or not minimum <= value <= MAX_HOSTS_PER_KIND:
        raise ValueError(f"{name} must be an integer from {minimum} to {MAX_HOSTS_PER_KIND}")


@dataclass(frozen=True)
class Host:
    """A place to run processes: its namespace, its address and the interface that has it."""

    name: str
    namespace: str
    address: str | None
    interface: str


@dataclass(frozen=True)
class Link:
    """A veth: ``device`` in the host's namespace, ``peer`` (a bridge port) in the ToR's."""

    host: str
    namespace: str
    device: str
    peer_namespace: str
    peer: str


@dataclass(frozen=True)
class Tc:
    """One ``tc`` object (``qdisc``, ``class`` or ``filter``) added on one device."""

    namespace: str
    device: str
    kind: str
    options: tuple[str, ...]

    def command(self) -> tuple[str, ...]:
        return ("tc", "-n", self.namespace, self.kind, "add", "dev", self.device, *self.options)


@dataclass(frozen=True)
class TestbedPlan:
    spec: TestbedSpec
    namespaces: tuple[str, ...]
    hosts: tuple[Host, ...]
    links: tuple[Link, ...]
    shaping: tuple[Tc, ...]
    bridge_address: str | None = field(default=None)

    @property
    def tor_namespace(self) -> str:
        return namespace_name(self.spec.id, TOR)

    @property
    def workers(self) -> tuple[Host, ...]:
        return tuple(h for h in self.hosts if h.name.startswith("w"))

    @property
    def servers(self) -> tuple[Host, ...]:
        return tuple(h for h in self.hosts if h.name.startswith("ps"))

    def host(self, name: str) -> Host:
        for host in self.hosts:
            if host.name == name:
                return host
        known = ", ".join(h.name for h in self.hosts)
        raise KeyError(f"no host {name!r} in testbed {self.spec.id!r} (hosts: {known})")

    def commands(self) -> list[tuple[str, ...]]:
        """The ``ip``/``tc`` command lines that build this plan, in order."""
        commands = [("ip", "netns", "add", ns) for ns in self.namespaces]
        commands += [("ip", "-n", ns, "link", "set", "lo", "up") for ns in self.namespaces]
        commands += [_reassembly_command(ns) for ns in self.namespaces]
        commands += self._bridge_commands()
        for link in self.links:
            commands += _link_commands(link, self.host(link.host).address, self.spec.loss > 0)
        commands += [t.command() for t in self.shaping]
        return commands

    def _bridge_commands(self) -> list[tuple[str, ...]]:
        tor = self.tor_namespace
        bridge = ("ip", "-n", tor, "link", "add", BRIDGE, "mtu", str(MTU), "type", "bridge")
        commands = [
            (*bridge, "stp_state", "0"),
            _plain_bridging_command(tor),
            ("ip", "-n", tor, "link", "set", BRIDGE, "up"),
        ]
        if self.bridge_address:
            address = f"{self.bridge_address}/{SUBNET_BITS}"
            commands.append(("ip", "-n", tor, "addr", "add", address, "dev", BRIDGE))
        return commands


# IP reassembly of 64 KiB datagrams (8 jumbo fragments): a namespace's default 4 MiB of
# reassembly memory is two windows of one worker; a host receiving several workers' windows
# fills it, and from then on every new fragment is dropped until incomplete datagrams expire
# after 30 s (since Linux 4.17 nothing else evicts them): a 30 s blackout for all UDP. The
# protocol retransmits within milliseconds, so a second is plenty to keep a partial datagram.
REASSEMBLY_MEMORY = 64 << 20
REASSEMBLY_SECONDS = 1


def _reassembly_command(namespace: str) -> tuple[str, ...]:
    return ("ip", "netns", "exec", namespace, "sysctl", "-q", "-w",
            f"net.ipv4.ipfrag_high_thresh={REASSEMBLY_MEMORY}",
            f"net.ipv4.ipfrag_time={REASSEMBLY_SECONDS}")  # fmt: skip


# A ToR switch forwards frames; it does not run the host's firewall on them. Where the host has
# br_netfilter loaded (container hosts do), every bridged frame would pass iptables, and bridged
# IP fragments would be reassembled for it and fragmented again: a third of the ToR's CPU for
# 64 KiB datagrams. Per namespace since Linux 5.3; -e: nothing to do where br_netfilter is absent.
def _plain_bridging_command(namespace: str) -> tuple[str, ...]:
    return ("ip", "netns", "exec", namespace, "sysctl", "-q", "-e", "-w",
            *(f"net.bridge.bridge-nf-call-{table}=0"
              for table in ("iptables", "ip6tables", "arptables")))  # fmt: skip


def _link_commands(link: Link, address: str | None, lossy: bool) -> list[tuple[str, ...]]:
    """Create the veth straight in its two namespaces, enslave its ToR end, address and raise
    it, both ends with jumbo frames (``MTU``). On a lossy link, GSO is limited to one segment
    per packet, so that loss, which acts per packet, hits single frames rather than 64 KiB
    super-packets."""
    ns, dev, tor, port = link.namespace, link.device, link.peer_namespace, link.peer
    commands = [
        ("ip", "link", "add", "name", dev, "netns", ns, "mtu", str(MTU), "type", "veth",
         "peer", "name", port, "netns", tor, "mtu", str(MTU)),
        ("ip", "-n", tor, "link", "set", port, "master", BRIDGE),
    ]  # fmt: skip
    if lossy:
        commands.append(("ip", "-n", ns, "link", "set", "dev", dev, "gso_max_segs", "1"))
        commands.append(("ip", "-n", tor, "link", "set", "dev", port, "gso_max_segs", "1"))
    commands.append(("ip", "-n", tor, "link", "set", port, "up"))
    if address:
        commands.append(("ip", "-n", ns, "addr", "add", f"{address}/{SUBNET_BITS}", "dev", dev))
    commands.append(("ip", "-n", ns, "link", "set", dev, "up"))
    return commands


def namespace_prefix(testbed_id: str) -> str:
    """All of a testbed's namespaces start with this; ids have no dashes, so no id's prefix is
    another's."""
    return f"{PREFIX}-{testbed_id}-"


def namespace_name(testbed_id: str, host: str) -> str:
    return namespace_prefix(testbed_id) + host


def worker_address(index: int) -> str:
    return f"{_WORKER_NET}.{index + 1}"


def ps_address(index: int) -> str:
    return f"{_PS_NET}.{index + 1}"


def plan(spec: TestbedSpec) -> TestbedPlan:
    """The full, deterministic plan for ``spec``."""
    tor = namespace_name(spec.id, TOR)
    end_hosts = [
        Host(f"w{i}", namespace_name(spec.id, f"w{i}"), worker_address(i), NIC)
        for i in range(spec.workers)
    ]
    end_hosts += [
        Host(f"ps{j}", namespace_name(spec.id, f"ps{j}"), ps_address(j), NIC)
        for j in range(spec.ps)
    ]
    hosts = list(end_hosts)
    if spec.switch:
        hosts.append(Host(SWITCH, tor, SWITCH_ADDRESS, BRIDGE))
    links = tuple(Link(h.name, h.namespace, NIC, tor, h.name) for h in end_hosts)
    shaping = []
    for link in links:
        shaping += link_shaping(spec, link.namespace, link.device)
        shaping += link_shaping(spec, link.peer_namespace, link.peer)
    return TestbedPlan(
        spec=spec,
        namespaces=(tor, *(h.namespace for h in end_hosts)),
        hosts=tuple(hosts),
        links=links,
        shaping=tuple(shaping),
        bridge_address=SWITCH_ADDRESS if spec.switch else None,
    )


def link_shaping(spec: TestbedSpec, namespace: str, device: str) -> list[Tc]:
    """Egress shaping of one end of a link (nothing for a plain link).

    An htb root whose default class 1:1 has the link rate and, as its queue, a bfifo of ``queue``
    seconds of line rate, or netem when there is a delay (the htb + netem pairing Mininet uses).
    Loss: a classic-BPF filter sends a random fraction of IP packets to class 1:2, whose queue
    (pfifo of length 0) drops all it gets; ARP is never lost, as on a real lossy link whose
    loss comes from congestion or corruption of data rather than of neighbour discovery.
    """
    if spec.rate is None and spec.delay == 0 and spec.loss == 0:
        return []
    rate = format_rate(spec.rate or UNSHAPED_RATE)
    burst = htb_burst(spec.rate or UNSHAPED_RATE)
    htb_class = f"htb rate {rate} ceil {rate} burst {burst} cburst {burst} quantum {_QUANTUM}"

    def tc(kind: str, options: str, *more: str) -> Tc:
        return Tc(namespace, device, kind, (*options.split(), *more))

    rules = [
        tc("qdisc", "root handle 1: htb default 1"),
        tc("class", f"parent 1: classid 1:1 {htb_class}"),
        tc("qdisc", "parent 1:1 handle 10:", *_queue(spec)),
    ]
    if spec.loss:
        rules += [
            tc("class", f"parent 1: classid 1:2 {htb_class}"),
            tc("qdisc", "parent 1:2 handle 20: pfifo limit 0"),
            tc(
                "filter",
                "parent 1: protocol ip prio 1 bpf bytecode",
                loss_bytecode(spec.loss),
                "classid",
                "1:2",
            ),
        ]
    return rules


def _queue(spec: TestbedSpec) -> tuple[str, ...]:
    rate_bytes = (spec.rate or UNSHAPED_RATE) / 8
    if spec.delay:
        packets = math.ceil(rate_bytes * (spec.queue + spec.delay) / _FRAME_BYTES)
        limit = max(_NETEM_MIN_LIMIT, packets)
        return ("netem", "delay", format_duration(spec.delay), "limit", str(limit))
    return ("bfifo", "limit", str(queue_bytes(spec.rate, spec.queue)))


def queue_bytes(rate: int | None, queue: float = TestbedSpec.queue) -> int:
    """What a link's queue holds before it drops (no delay): ``queue`` seconds of its rate,
    and one GSO super-packet more."""
    return math.ceil((rate or UNSHAPED_RATE) / 8 * queue) + _MIN_BURST_BYTES


def htb_burst(rate: int) -> int:
    """Bucket size in bytes for a link of ``rate`` bit/s."""
    return max(_MIN_BURST_BYTES, math.ceil(rate / 8 * _BURST_SECONDS))


def loss_threshold(loss: float) -> int:
    """A random u32 below this is lost: round(loss * 2**32)."""
    return round(loss * 2**32)


def loss_bytecode(loss: float) -> str:
    """tc's classic-BPF program (``count,code jt jf k,...``) that matches with probability
    ``loss``: A = random; if A >= threshold return 0 (no match) else return -1 (match)."""
    program = [
        (0x20, 0, 0, _BPF_RANDOM),  # ld [SKF_AD_RANDOM]
        (0x35, 0, 1, loss_threshold(loss)),  # jge #threshold, keep, lose
        (0x06, 0, 0, 0),  # keep: ret #0
        (0x06, 0, 0, 0xFFFFFFFF),  # lose: ret #-1 (the filter's classid)
    ]
    return ",".join([str(len(program))] + [f"{c} {t} {f} {k}" for c, t, f, k in program])


def parse_netns_list(text: str) -> list[str]:
    """Names from ``ip netns list`` output (lines like ``name (id: 3)`` or ``name``)."""
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def owned_namespaces(names: list[str], testbed_id: str) -> list[str]:
    """The namespaces among ``names`` that belong to testbed ``testbed_id``, sorted."""
    prefix = namespace_prefix(testbed_id)
    return sorted(n for n in names if n.startswith(prefix))


def ids_from_namespaces(names: list[str]) -> list[str]:
    """Ids of all gradsum testbeds that have at least one namespace among ``names``."""
    ids = set()
    for name in names:
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == PREFIX and ID_PATTERN.fullmatch(parts[1]):
            ids.add(parts[1])
    return sorted(ids)


_LOSS_QDISC = re.compile(r"qdisc pfifo 20: .*?\n\s*Sent \d+ bytes \d+ pkt \(dropped (\d+),", re.S)


def parse_loss_drops(tc_stats: str) -> int:
    """Packets the loss rule dropped, from ``tc -s qdisc show dev D`` output (0 if none)."""
    match = _LOSS_QDISC.search(tc_stats)
    return int(match.group(1)) if match else 0
