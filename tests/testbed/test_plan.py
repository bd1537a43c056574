"""The pure topology planner: namespaces, links, addresses, tc rules and the commands."""

import ipaddress
import random

import pytest

from gradsum.testbed.plan import (
    BRIDGE,
    SWITCH_ADDRESS,
    TestbedSpec,
    htb_burst,
    ids_from_namespaces,
    link_shaping,
    loss_bytecode,
    owned_namespaces,
    parse_loss_drops,
    parse_netns_list,
    plan,
)

GBIT = 10**9


def spec(**fields):
    return TestbedSpec(**{"id": "t1", **fields})


def test_plan_is_deterministic():
    one = plan(spec(workers=4, switch=True, ps=2, rate=GBIT, loss=0.01, delay=0.001))
    two = plan(spec(workers=4, switch=True, ps=2, rate=GBIT, loss=0.01, delay=0.001))
    assert one == two
    assert one.commands() == two.commands()


def test_one_namespace_per_host_plus_the_tor():
    p = plan(spec(workers=3, ps=2, switch=True))
    assert p.namespaces == (
        "gradsum-t1-tor",
        "gradsum-t1-w0",
        "gradsum-t1-w1",
        "gradsum-t1-w2",
        "gradsum-t1-ps0",
        "gradsum-t1-ps1",
    )
    assert [h.name for h in p.hosts] == ["w0", "w1", "w2", "ps0", "ps1", "switch"]


def test_each_worker_and_server_has_one_link_to_a_bridge_port_named_after_it():
    p = plan(spec(workers=2, ps=1))
    assert [(link.namespace, link.device, link.peer_namespace, link.peer) for link in p.links] == [
        ("gradsum-t1-w0", "eth0", "gradsum-t1-tor", "w0"),
        ("gradsum-t1-w1", "eth0", "gradsum-t1-tor", "w1"),
        ("gradsum-t1-ps0", "eth0", "gradsum-t1-tor", "ps0"),
    ]
    enslaved = [c for c in p.commands() if c[-2:] == ("master", BRIDGE)]
    assert [c[5] for c in enslaved] == ["w0", "w1", "ps0"]


def test_switch_lives_in_the_tor_with_one_port_per_worker():
    p = plan(spec(workers=4, switch=True))
    switch = p.host("switch")
    assert switch.namespace == p.tor_namespace
    assert (switch.address, switch.interface) == (SWITCH_ADDRESS, BRIDGE)
    ports = [link.peer for link in p.links if link.peer_namespace == switch.namespace]
    assert ports == ["w0", "w1", "w2", "w3"]
    assert ("ip", "-n", "gradsum-t1-tor", "addr", "add", f"{SWITCH_ADDRESS}/16", "dev", BRIDGE) in (
        p.commands()
    )


def test_without_switch_the_bridge_has_no_address_and_there_is_no_switch_host():
    p = plan(spec(workers=2))
    assert not any(c[3:5] == ("addr", "add") and c[2] == p.tor_namespace for c in p.commands())
    with pytest.raises(KeyError, match="no host 'switch'"):
        p.host("switch")


def test_addresses_are_unique_and_in_one_subnet():
    p = plan(spec(workers=254, ps=254, switch=True))
    addresses = [ipaddress.ip_address(h.address) for h in p.hosts]
    assert len(set(addresses)) == len(addresses)
    subnet = ipaddress.ip_network("10.77.0.0/16")
    assert all(a in subnet and a not in (subnet.network_address, subnet.broadcast_address)
               for a in addresses)  # fmt: skip


def test_every_command_stays_inside_the_testbed_namespaces():
    p = plan(spec(workers=3, ps=1, switch=True, rate=GBIT, loss=0.02, delay=0.002))
    ours = set(p.namespaces)
    for command in p.commands():
        if command[:3] == ("ip", "netns", "add"):
            assert command[3] in ours
        elif command[:3] == ("ip", "link", "add"):  # a veth created straight in two namespaces
            netns = [command[i + 1] for i, word in enumerate(command) if word == "netns"]
            assert len(netns) == 2 and set(netns) <= ours, command
        elif command[:3] == ("ip", "netns", "exec"):  # sysctls of the namespace's own stack
            assert command[3] in ours and command[4] == "sysctl", command
        else:
            assert command[1] == "-n" and command[2] in ours, command


def test_namespaces_exist_before_they_are_used_and_bridge_before_its_ports():
    commands = plan(spec(workers=2, switch=True, rate=GBIT, loss=0.01)).commands()
    created = set()
    bridge_at = next(i for i, c in enumerate(commands) if "bridge" in c)
    for i, command in enumerate(commands):
        if command[:3] == ("ip", "netns", "add"):
            created.add(command[3])
        elif command[1] == "-n":
            assert command[2] in created
        if command[-2:] == ("master", BRIDGE):
            assert i > bridge_at


def test_both_ends_of_every_link_are_shaped():
    p = plan(spec(workers=2, ps=1, switch=True, rate=100 * 10**6))
    roots = {(t.namespace, t.device) for t in p.shaping if t.options[:1] == ("root",)}
    ends = {(link.namespace, link.device) for link in p.links}
    ends |= {(link.peer_namespace, link.peer) for link in p.links}
    assert roots == ends
    classes = [t for t in p.shaping if t.kind == "class"]
    assert len(classes) == len(ends)
    assert all(t.options[5:9] == ("rate", "100mbit", "ceil", "100mbit") for t in classes)


def test_plain_links_get_no_tc_rules():
    assert plan(spec(workers=2, switch=True)).shaping == ()


def test_shaping_rules_come_in_order_root_class_queue_then_loss():
    rules = link_shaping(spec(rate=GBIT, loss=0.01), "ns", "eth0")
    assert [(t.kind, t.options[:2]) for t in rules] == [
        ("qdisc", ("root", "handle")),
        ("class", ("parent", "1:")),
        ("qdisc", ("parent", "1:1")),
        ("class", ("parent", "1:")),
        ("qdisc", ("parent", "1:2")),
        ("filter", ("parent", "1:")),
    ]
    assert rules[0].command()[:7] == ("tc", "-n", "ns", "qdisc", "add", "dev", "eth0")
    assert rules[4].options[-3:] == ("pfifo", "limit", "0")  # the loss class drops all it gets
    assert rules[5].options[-2:] == ("classid", "1:2")
    assert "ip" in rules[5].options  # ARP is never lost


def test_queue_holds_the_configured_time_at_line_rate():
    rules = link_shaping(spec(rate=GBIT, queue=0.01), "ns", "eth0")
    kind, limit = rules[2].options[4], int(rules[2].options[6])
    assert kind == "bfifo"
    assert limit >= GBIT / 8 * 0.01


def test_delay_uses_netem_as_the_queue():
    rules = link_shaping(spec(rate=GBIT, delay=0.0025), "ns", "eth0")
    assert rules[2].options[4:7] == ("netem", "delay", "2500us")
    assert int(rules[2].options[8]) >= 1000


def test_unshaped_but_lossy_links_still_get_a_class():
    rules = link_shaping(spec(loss=0.1), "ns", "eth0")
    assert any(t.kind == "filter" for t in rules)


def test_burst_holds_a_gso_packet_and_a_millisecond_at_high_rates():
    assert htb_burst(100 * 10**6) == 64 * 1024
    assert htb_burst(10 * GBIT) == 10 * GBIT // 8 // 1000


def run_classic_bpf(bytecode: str, random_value: int) -> int:
    """A tiny interpreter for the instructions loss_bytecode uses."""
    count, *lines = bytecode.split(",")
    program = [tuple(int(x) for x in line.split()) for line in lines]
    assert int(count) == len(program)
    pc, accumulator = 0, 0
    while True:
        code, jump_true, jump_false, k = program[pc]
        if code == 0x20:  # ld [k]: only the random ancillary word is used
            assert k == 0xFFFFF000 + 56
            accumulator, pc = random_value, pc + 1
        elif code == 0x35:  # jge #k
            pc += 1 + (jump_true if accumulator >= k else jump_false)
        elif code == 0x06:  # ret #k
            return k
        else:
            raise AssertionError(f"unexpected opcode {code}")


@pytest.mark.parametrize("loss", [0.001, 0.01, 0.05, 0.5])
def test_loss_program_matches_the_configured_fraction(loss):
    bytecode = loss_bytecode(loss)
    threshold = round(loss * 2**32)
    assert run_classic_bpf(bytecode, threshold - 1) == 0xFFFFFFFF  # lost
    assert run_classic_bpf(bytecode, threshold) == 0  # kept
    rng = random.Random(0)
    samples = 20_000
    lost = sum(run_classic_bpf(bytecode, rng.getrandbits(32)) != 0 for _ in range(samples))
    assert abs(lost / samples - loss) < 5 * (loss * (1 - loss) / samples) ** 0.5 + 1e-4


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"id": "a-b"}, "testbed id"),
        ({"id": "Upper"}, "testbed id"),
        ({"id": "x" * 17}, "testbed id"),
        ({"workers": 0}, "workers"),
        ({"ps": 255}, "ps"),
        ({"rate": 100}, "rate"),
        ({"loss": 1.0}, "loss"),
        ({"delay": -0.001}, "delay"),
        ({"queue": 0.0}, "queue"),
    ],
)
def test_spec_rejects_bad_values_naming_them(fields, message):
    with pytest.raises(ValueError, match=message):
        spec(**fields)


def test_spec_json_round_trip():
    original = spec(workers=3, ps=1, switch=True, rate=GBIT, delay=0.001, loss=0.01)
    assert TestbedSpec.from_json(original.to_json()) == original


def test_namespace_ownership_never_mixes_testbeds():
    names = ["gradsum-1-w0", "gradsum-1-tor", "gradsum-10-w0", "gradsum-1x-w0", "other-1-w0"]
    assert owned_namespaces(names, "1") == ["gradsum-1-tor", "gradsum-1-w0"]
    assert ids_from_namespaces([*names, "gradsum-bad", "gradsum-UP-w0"]) == ["1", "10", "1x"]


def test_parse_netns_list_handles_ids_and_bare_names():
    assert parse_netns_list("gradsum-1-w0 (id: 3)\nfoo\n\n") == ["gradsum-1-w0", "foo"]


def test_lossy_links_send_single_frames_so_loss_is_per_frame():
    p = plan(spec(workers=2, switch=True, loss=0.01))
    limited = {(c[2], c[6]) for c in p.commands() if c[-2:] == ("gso_max_segs", "1")}
    ends = {(link.namespace, link.device) for link in p.links}
    ends |= {(link.peer_namespace, link.peer) for link in p.links}
    assert limited == ends
    assert not any("gso_max_segs" in c for c in plan(spec(workers=2)).commands())


TC_STATS = """qdisc htb 1: root refcnt 3 r2q 10 default 0x1 direct_packets_stat 0 direct_qlen 1000
 Sent 1849773 bytes 7651 pkt (dropped 359, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
qdisc bfifo 10: parent 1:1 limit 2565536b
 Sent 1849773 bytes 7651 pkt (dropped 7, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
qdisc pfifo 20: parent 1:2 limit 0p
 Sent 0 bytes 0 pkt (dropped 352, overlimits 0 requeues 0)
 backlog 0b 0p requeues 0
"""


def test_loss_drops_are_read_from_the_loss_queue_only():
    assert parse_loss_drops(TC_STATS) == 352
    assert parse_loss_drops(TC_STATS.split("qdisc pfifo")[0]) == 0


def test_every_namespace_gets_reassembly_memory_and_a_short_fragment_timeout():
    tuned = sysctl_settings(plan(spec(workers=2, ps=1, switch=True)))
    assert set(tuned) == set(plan(spec(workers=2, ps=1, switch=True)).namespaces)
    for settings in tuned.values():
        assert "net.ipv4.ipfrag_high_thresh=67108864" in settings
        assert "net.ipv4.ipfrag_time=1" in settings


def test_the_tor_bridges_frames_without_the_hosts_firewall():
    p = plan(spec(workers=2, ps=1, switch=True))
    tuned = sysctl_settings(p)
    for table in ("iptables", "ip6tables", "arptables"):
        assert f"net.bridge.bridge-nf-call-{table}=0" in tuned[p.tor_namespace]
        for namespace in set(p.namespaces) - {p.tor_namespace}:  # no bridge there
            assert f"net.bridge.bridge-nf-call-{table}=0" not in tuned[namespace]
    # -e: hosts without br_netfilter have no such keys, and that is fine
    bridging = [c for c in p.commands() if "net.bridge.bridge-nf-call-iptables=0" in c]
    assert len(bridging) == 1 and "-e" in bridging[0]


def sysctl_settings(p) -> dict[str, list[str]]:
    """namespace -> every key=value its sysctl commands set"""
    tuned: dict[str, list[str]] = {}
    for command in p.commands():
        if command[:3] == ("ip", "netns", "exec") and command[4] == "sysctl":
            tuned.setdefault(command[3], []).extend(a for a in command[5:] if "=" in a)
    return tuned
