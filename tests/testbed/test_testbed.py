"""Real testbeds (root + network namespaces): shaped rates, loss, Gloo across namespaces, cleanup.

Assertions hold whatever the machine's speed: rates are checked against the configured link rate
(100 Mbit/s, far below what two cores push through a veth), loss against the configured fraction.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from gradsum.cli import main
from gradsum.testbed import RemoteError, Tc, TestbedError, probe, shell
from gradsum.testbed.gloo import gloo_allreduce, ring_wire_seconds
from gradsum.testbed.plan import owned_namespaces

MBIT = 10**6
# TCP payload per 1514-byte frame of a shaped link: 1448 bytes (timestamps on).
TCP_GOODPUT = 1448 / 1514
# a sender process's start-up in a namespace (Python + imports), with room for a loaded host
SENDER_START_UP_S = 3.0


def assert_gone(testbed_id: str) -> None:
    assert owned_namespaces(shell.list_namespaces(), testbed_id) == []
    assert shell.read_state(testbed_id) is None


def tcp_rate(tb, source: str, destination: str, nbytes: int, port: int = 5001) -> float:
    receiver = tb.start_call(destination, probe.tcp_receive, args=(port, nbytes))
    tb.call(source, probe.tcp_send, args=(tb.address(destination), port, nbytes))
    return receiver.result(30)["bits_per_s"]


def udp_delivered(tb, source: str, destination: str, count: int, port: int = 5002) -> float:
    receiver = tb.start_call(destination, probe.udp_receive, args=(port, count))
    tb.call(source, probe.udp_send, args=(tb.address(destination), port, count),
            kwargs={"rate_pps": 10_000})  # fmt: skip
    return receiver.result(30) / count


def test_shaped_links_carry_the_configured_rate_each_way(make_testbed):
    rate = 100 * MBIT
    with make_testbed(2, switch=True, rate="100mbit") as tb:
        # worker -> switch crosses only w0's egress, switch -> worker only the ToR port's:
        # each direction of the link is shaped on its own; worker -> worker crosses both links.
        for source, destination in [("w0", "switch"), ("switch", "w0"), ("w1", "w0")]:
            measured = tcp_rate(tb, source, destination, 3_000_000)
            assert measured == pytest.approx(rate * TCP_GOODPUT, rel=0.2), (source, destination)
    assert_gone(tb.id)


def test_a_server_host_has_one_nic_so_its_incast_shares_it(make_testbed):
    rate, nbytes = 100 * MBIT, 4_000_000
    with make_testbed(2, ps=1, rate="100mbit") as tb:
        ports = {"w0": 5011, "w1": 5012}
        receivers = [
            tb.start_call("ps0", probe.tcp_receive, args=(p, nbytes)) for p in ports.values()
        ]
        # both push from one instant, whatever their processes' start-up took on a busy host
        start_at = time.monotonic() + SENDER_START_UP_S
        senders = [
            tb.start_call(w, probe.tcp_send, args=(tb.address("ps0"), p, nbytes),
                          kwargs={"start_at": start_at})
            for w, p in ports.items()
        ]  # fmt: skip
        for sender in senders:
            sender.result(30)
        flows = [r.result(30) for r in receivers]
    # While both flows run (from the later first byte to the earlier last one) each worker's own
    # link could carry the full rate, so two unshared paths would deliver twice it; through the
    # server's one NIC together they get at most one link's rate. The window, not the whole
    # span: two TCP slow starts at once overflow the 20 ms drop-tail queue, and one flow may wait
    # out 200-400 ms of retransmission timeouts while the other runs alone (in one CI run the
    # flows overlapped for only 0.47 of their span).
    both_from = max(f["first_byte_at"] for f in flows)
    both_until = min(f["end_at"] for f in flows)
    assert both_until - both_from > 0.25  # the two workers really pushed at the same time
    together = sum(_bytes_between(f["timeline"], both_from, both_until) for f in flows)
    assert together * 8 / (both_until - both_from) < 1.2 * rate * TCP_GOODPUT
    # and the NIC was not starved: over the whole span, at least half of one link (73 % of the
    # rate in one run, with a retransmission timeout)
    start = min(f["first_byte_at"] for f in flows)
    end = max(f["end_at"] for f in flows)
    assert 2 * nbytes * 8 / (end - start) > 0.5 * rate * TCP_GOODPUT


def test_loss_is_applied_on_every_link_direction(make_testbed):
    with make_testbed(2, switch=True, rate="1gbit", loss="5%") as tb:
        one_link_up = 1 - udp_delivered(tb, "w0", "switch", 3000)
        one_link_down = 1 - udp_delivered(tb, "switch", "w1", 3000)
        two_links = 1 - udp_delivered(tb, "w0", "w1", 3000)
        tc = tb.run("w0", ["tc", "-s", "qdisc", "show", "dev", "eth0"]).stdout
        link = tb.run("w0", ["ip", "-d", "link", "show", "dev", "eth0"]).stdout
    # 3000 datagrams at 5%: sigma = 0.4%, so these bands are 5 sigma wide.
    assert 0.03 < one_link_up < 0.07
    assert 0.03 < one_link_down < 0.07
    assert 0.07 < two_links < 0.125  # 1 - 0.95^2 = 9.75%
    assert "gso_max_segs 1 " in link
    assert "pfifo 20:" in tc and "dropped 0," not in tc.split("pfifo 20:")[1].splitlines()[1]


def test_delay_is_applied_or_refused_with_the_reason(make_testbed):
    tb = make_testbed(1, switch=True, rate="1gbit", delay="2ms")
    try:
        tb.up()
    except TestbedError as error:  # kernels without netem, like this project's machines
        assert "CONFIG_NET_SCH_NETEM" in str(error)
        assert_gone(tb.id)
        return
    with tb:
        receiver = tb.start_call("switch", probe.udp_receive, args=(5003, 1))
        rtts = tb.call("w0", probe.udp_rtt, args=(tb.address("switch"), 5003, 10))
        receiver.result(30)
    assert min(rtts) >= 2 * 0.002


def test_processes_see_their_host_and_run_helpers_report_errors(make_testbed):
    with make_testbed(2, switch=True) as tb:
        env = tb.run("w1", ["sh", "-c", "echo $GRADSUM_TESTBED_HOST $GRADSUM_TESTBED_ADDR"])
        assert env.stdout.split() == ["w1", "10.77.1.2"]
        assert "w0=10.77.1.1" in tb.environment("w1")["GRADSUM_TESTBED_HOSTS"]
        assert tb.run_module("w1", "json.tool", input='{"a": 1}').stdout.split() == [
            "{",
            '"a":',
            "1",
            "}",
        ]
        with pytest.raises(TestbedError, match="exited 3"):
            tb.run("w0", ["sh", "-c", "exit 3"])
        with pytest.raises(RemoteError, match="ConnectionRefusedError"):
            tb.call("w0", probe.tcp_send, args=("10.77.1.2", 5999, 10), kwargs={"timeout": 0.2})
        sleeper = tb.popen("w0", ["sleep", "60"])
        reassembly = ["sysctl", "-n", "net.ipv4.ipfrag_time", "net.ipv4.ipfrag_high_thresh"]
        assert tb.run("w1", reassembly).stdout.split() == ["1", str(64 << 20)]
    assert sleeper.poll() is not None  # stopped when the testbed went down
    assert_gone(tb.id)
    host = subprocess.run(["sysctl", "-n", "net.ipv4.ipfrag_time"], capture_output=True, text=True)
    assert host.stdout.strip() != "1" or host.returncode != 0  # the host's own stack untouched


def test_an_exception_inside_the_block_still_removes_everything(make_testbed):
    tb = make_testbed(2, switch=True, ps=1, rate="100mbit", loss="1%")
    with pytest.raises(RuntimeError, match="midway"), tb:
        assert len(owned_namespaces(shell.list_namespaces(), tb.id)) == 4
        raise RuntimeError("midway")
    assert_gone(tb.id)


def test_a_failing_command_midway_through_up_rolls_back(make_testbed):
    tb = make_testbed(2, rate="100mbit")
    broken = Tc(tb.plan.tor_namespace, "w1", "qdisc", ("root", "handle", "9:", "no-such-qdisc"))
    tb.plan = dataclasses.replace(tb.plan, shaping=(*tb.plan.shaping, broken))
    with pytest.raises(TestbedError, match="no-such-qdisc"):
        tb.up()
    assert_gone(tb.id)


CRASH = """
import os, subprocess, sys
from gradsum.testbed import Testbed
tb = Testbed(2, switch=True, rate="100mbit", id=sys.argv[1]).up()
tb.popen("w0", ["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("up", flush=True)
os._exit(1)  # a crash: no down
"""


def crash_leaving_testbed(testbed_id: str) -> None:
    done = subprocess.run([sys.executable, "-c", CRASH, testbed_id], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.stdout.strip() == "up", done.stderr
    assert len(owned_namespaces(shell.list_namespaces(), testbed_id)) == 3


def sleepers_in(testbed_id: str) -> list[int]:
    return [p for ns in owned_namespaces(shell.list_namespaces(), testbed_id)
            for p in shell.namespace_pids(ns)]  # fmt: skip


def test_up_over_a_crashed_testbed_cleans_it_first(make_testbed):
    tb = make_testbed(2, switch=True, rate="100mbit")
    crash_leaving_testbed(tb.id)
    assert sleepers_in(tb.id)
    with tb:
        assert sleepers_in(tb.id) == []  # the crashed one's process went with it
        assert tb.run("w1", ["ip", "-br", "addr", "show", "eth0"]).stdout.count("10.77.1.2") == 1
    assert_gone(tb.id)


KILLED = """
import subprocess, sys, time
from gradsum.testbed import Testbed
with Testbed(2, switch=True, rate="100mbit", id=sys.argv[1]) as tb:
    tb.popen("w0", ["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print("up", flush=True)
    time.sleep(600)
"""


def test_a_sigterm_while_the_testbed_is_up_removes_it(make_testbed):
    testbed_id = make_testbed().id
    process = subprocess.Popen([sys.executable, "-c", KILLED, testbed_id], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        assert process.stdout.readline().strip() == "up", process.stderr.read()
        pids = sleepers_in(testbed_id)
        assert pids
        process.terminate()
        assert process.wait(timeout=60) == 128 + 15, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert_gone(testbed_id)
    assert not any(shell._alive(pid) for pid in pids)


def cli(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``gradsum testbed ARGV`` in a fresh process."""
    return subprocess.run([sys.executable, "-m", "gradsum.cli", "testbed", *argv],
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.slow  # each fresh `gradsum` process imports torch (seconds)
def test_cli_finds_and_removes_a_crashed_testbed_from_a_fresh_process(make_testbed):
    testbed_id = make_testbed().id
    crash_leaving_testbed(testbed_id)
    status = json.loads(cli("status", "--json").stdout)
    mine = [s for s in status if s["id"] == testbed_id]
    assert mine and mine[0]["state"] == "up"
    pids = sleepers_in(testbed_id)
    done = cli("down", "--id", testbed_id)
    assert done.returncode == 0 and "removed 3 namespaces" in done.stdout
    assert_gone(testbed_id)
    assert pids and not any(shell._alive(pid) for pid in pids)  # zombies may await their reaper


@pytest.mark.slow  # each fresh `gradsum` process imports torch (seconds)
def test_cli_up_status_exec_down(make_testbed, capsys):
    testbed_id = make_testbed().id
    assert main(["testbed", "up", "--id", testbed_id, "--workers", "2", "--ps", "1",
                 "--rate", "1gbit"]) == 0  # fmt: skip
    assert "ps0      gradsum-" in capsys.readouterr().out
    run = cli("exec", "--id", testbed_id, "ps0", "--", "sh", "-c", "ip -br addr; exit 4")
    assert run.returncode == 4 and "10.77.2.1/16" in run.stdout
    shaped = cli("exec", "--id", testbed_id, "w0", "--", "tc", "class", "show", "dev", "eth0")
    assert "rate 1Gbit" in shaped.stdout
    assert main(["testbed", "down", "--id", testbed_id]) == 0
    assert "removed 4 namespaces" in capsys.readouterr().out
    assert main(["testbed", "status"]) == 0
    assert testbed_id not in capsys.readouterr().out
    assert_gone(testbed_id)


@pytest.mark.slow
def test_gloo_allreduce_across_namespaces_is_bound_by_the_links(make_testbed):
    elements = 1 << 18
    with make_testbed(2, rate="100mbit") as tb:
        result = gloo_allreduce(tb, elements, iterations=3, warmup=1)
    assert result.workers == 2 and len(result.seconds) == 3  # the sum was checked on each rank
    wire = ring_wire_seconds(elements, 2, 100 * MBIT)
    assert result.median_seconds > 0.95 * wire  # the traffic really crossed the shaped links
    assert result.row()["link_rate"] == 100 * MBIT
    assert result.ate_per_s == pytest.approx(elements / result.median_seconds)


def _bytes_between(timeline: list, start: float, stop: float) -> float:
    """Bytes a flow received in [start, stop], from its (time, bytes so far) timeline."""
    times, received = zip(*timeline, strict=True)
    return float(np.interp(stop, times, received) - np.interp(start, times, received))
