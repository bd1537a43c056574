"""The native datagram pump: what it places, what it lets go, and that a transport running on it
gives the Python loop's results (real UDP on loopback, daemon and workers as threads)."""

import socket
import struct
import threading

import numpy as np
import pytest
import torch

from gradsum.codecs import bfp_native, make_codec, run_round
from gradsum.codecs.round import CodecRound, SumPhase
from gradsum.dataplane import DataPlane, switch_profile
from gradsum.dataplane.codec_wire import wire_format
from gradsum.dataplane.collective import JobHandle
from gradsum.dataplane.packet import ANY_WORKER, HEADER_SIZE, Header, Kind, Op, parse_header
from gradsum.dataplane.stream import ChunkLayout
from gradsum.dataplane.transfer import LaneBuffers, Transfer
from gradsum.net import pump
from gradsum.net.client import SwitchClient
from gradsum.net.daemon import Daemon
from gradsum.net.loopback import WorkerTask, worker_input
from gradsum.net.udp import enable_gro, open_socket

pytestmark = pytest.mark.skipif(not pump.available(), reason="the _pump extension is not built")


def test_the_pump_places_expected_results_and_lets_everything_else_go():
    with open_socket(("127.0.0.1", 0)) as worker, open_socket(("127.0.0.1", 0)) as switch, \
            open_socket(("127.0.0.1", 0)) as stranger:  # fmt: skip
        layout = ChunkLayout(lanes=20, lanes_per_chunk=8, in_bits=32, out_bits=32)
        up = np.arange(20, dtype=np.int32)
        down = np.zeros(20, dtype=np.int32)
        buffers = LaneBuffers(layout, memoryview(up).cast("B"), memoryview(down).cast("B"))
        transfer = Transfer(job=7, worker=1, op=Op.SUM, first_chunk=4, slots=2, buffers=buffers,
                            max_contributors=3)  # fmt: skip
        job = JobHandle(switch.getsockname(), 7, 1, 2, 8, 3)
        assert pump.serves([(job, transfer)])
        routes = pump.Routes([(job, transfer)])

        def result(chunk, lanes, job_id=7, kind=Kind.RESULT, contributors=3, values=None):
            v, s = (chunk // 2) % 2, chunk % 2
            header = Header(kind, job_id, ANY_WORKER, s, v, Op.SUM, 0, chunk, lanes, contributors)
            data = np.full(lanes, 100 + chunk, np.int32) if values is None else values
            return header.pack() + data.tobytes()

        target = worker.getsockname()
        stranger.sendto(result(4, 8), target)  # the right packet from the wrong address
        switch.sendto(b"GS garbage", target)
        switch.sendto(result(4, 8, job_id=8), target)  # another job
        switch.sendto(result(9, 8), target)  # a chunk outside the transfer
        switch.sendto(result(5, 7), target)  # wrong lane count
        switch.sendto(result(5, 8, contributors=4), target)  # more contributors than workers
        switch.sendto(result(4, 8), target)  # expected: placed
        switch.sendto(result(4, 8, values=np.zeros(8, np.int32)), target)  # a repeat
        switch.sendto(result(6, 4), target)  # the short last chunk
        switch.sendto(result(5, 8, kind=Kind.STALE, values=np.zeros(0, np.int32)), target)
        fd = worker.fileno()
        events = []
        for _ in range(20):
            events += routes.receive([fd], 0.05)
            if len(events) >= 4:
                break
        assert events == [
            (0, 4, 3, 0, pump.PLACED),
            (0, 4, 3, 0, pump.REPEAT),
            (0, 6, 3, 0, pump.PLACED),
            (0, 5, 3, 0, pump.STALE),
        ]
        assert down.tolist() == [104] * 8 + [0] * 8 + [106] * 4  # the repeat did not overwrite

        # chunk 5 (lanes 8..15) goes out; chunk 6 has its result: a resend repeats only
        # packets that have none, so nothing of it goes
        routes.send(worker.fileno(), [(0, 5), (0, 6)])
        switch.settimeout(2)
        data, source = switch.recvfrom(1 << 16)
        assert source == worker.getsockname()
        assert data[:HEADER_SIZE] == Header(Kind.DATA, 7, 1, 1, 0, Op.SUM, 0, 5, 8, 1).pack()
        assert np.frombuffer(data[HEADER_SIZE:], np.int32).tolist() == list(range(8, 16))
        switch.settimeout(0.2)
        with pytest.raises(TimeoutError):
            switch.recvfrom(1 << 16)


@pytest.mark.parametrize("pumped", [True, False])
def test_a_pumped_transport_gives_the_python_loops_results_under_loss(monkeypatch, pumped):
    monkeypatch.setenv("GRADSUM_PUMP", "1" if pumped else "0")
    task = WorkerTask((), job=3, workers=3, codec="bfp", elements=50_000, steps=2)
    sock = open_socket(("127.0.0.1", 0))
    daemon = Daemon(DataPlane(switch_profile()), sock, drop_rate=0.05, seed=11)
    serving = threading.Thread(target=daemon.serve, daemon=True)
    serving.start()
    address = sock.getsockname()
    bfp, wire = task.codec_and_wire()
    options = {"workers": 3, "slots": 4, "elements": 1024, "multicast": True}
    clients = [SwitchClient([address], wire, job=3, worker=w, **options) for w in range(3)]
    try:
        clients[0].register([c.address for c in clients])
        outputs: dict = {}

        def work(w):
            outputs[w] = [clients[w].allreduce(worker_input(task, w, s), bfp) for s in range(2)]

        threads = [threading.Thread(target=work, args=(w,)) for w in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        daemon.stop.set()
        serving.join(timeout=5)
        for client in clients:
            client.close()
        sock.close()
    codec = make_codec("bfp", workers=3)
    for step in range(2):
        inputs = [worker_input(task, w, step) for w in range(3)]
        want = run_round(codec, inputs, seed=0, step=step).average.numpy()
        for w in range(3):
            np.testing.assert_array_equal(outputs[w][step].numpy(), want)
    assert daemon.stats.as_dict()["received"] > 3 * 2 * 49  # lost packets were resent


SMALL = (3 * 4096 + 1003, 4096, 256)  # coordinates, partition, lanes a packet
AT_SCALE = ((1 << 21) + 1003, 1 << 20, None)  # the default partitions and packets


@pytest.mark.parametrize(
    ("pumped", "mtu", "sizes"),
    [(True, None, SMALL), (True, 1500, SMALL), (False, None, SMALL), (True, None, AT_SCALE)],
    ids=["pump", "pump-mtu", "python", "pump-2^21+1003"],
)
def test_bfp_packets_coded_as_they_go_give_the_rounds_bits(monkeypatch, pumped, mtu, sizes):
    """bfp's packets encoded as they are sent and decoded where they land (``LaneCoder``): in C
    by the pump, in Python by the transfers otherwise. Several partitions and pieces, two
    shards (a route's lanes start inside the round), a last piece padded to whole bytes, lost
    packets resent (encoded again), and with ``mtu`` chunks of several frame-sized packets sent
    in one GSO send and read back joined by GRO: the in-process round's bits; also at the size
    users run (2^21 + 1003 coordinates in partitions of 2^20, 64 KiB packets)."""
    monkeypatch.setenv("GRADSUM_PUMP", "1" if pumped else "0")
    coders, decoded = [], []
    lane_coder, decode = SumPhase.lane_coder, bfp_native.LaneCoder.decode

    def recorded_coder(phase):
        coders.append(lane_coder(phase))
        return coders[-1]

    def recorded_decode(coder, first, *rest):
        decoded.append(first)
        decode(coder, first, *rest)

    monkeypatch.setattr(SumPhase, "lane_coder", recorded_coder)
    monkeypatch.setattr(bfp_native.LaneCoder, "decode", recorded_decode)
    workers, (length, partition, elements) = 3, sizes
    inputs = [torch.randn(length, generator=torch.Generator().manual_seed(w)) * 10.0**w
              for w in range(workers)]  # fmt: skip
    sockets = [open_socket(("127.0.0.1", 0)) for _ in range(2)]
    daemons = [Daemon(DataPlane(switch_profile()), s, drop_rate=0.05, seed=5 + i)
               for i, s in enumerate(sockets)]  # fmt: skip
    serving = [threading.Thread(target=d.serve, daemon=True) for d in daemons]
    for thread in serving:
        thread.start()
    bfp = make_codec("bfp", workers=workers)
    wire = wire_format(bfp)
    options = {"workers": workers, "slots": 4, "multicast": True}
    options |= {"mtu": mtu} if mtu else {"elements": elements} if elements else {}
    shards = [s.getsockname() for s in sockets]
    clients = [SwitchClient(shards, wire, job=4, worker=w, **options) for w in range(workers)]
    outputs: dict = {}
    try:
        clients[0].register([c.address for c in clients])

        def work(w):
            own = make_codec("bfp", workers=workers)
            rounds = CodecRound(own, 0, partition)
            outputs[w] = [rounds.run(inputs[w], clients[w].collective, worker=w, key=None,
                                     step=s) for s in range(2)]  # fmt: skip

        threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        for daemon, thread in zip(daemons, serving, strict=True):
            daemon.stop.set()
            thread.join(timeout=5)
        for c in clients:
            c.close()
        for s in sockets:
            s.close()
    assert len(coders) == 2 * workers and all(c is not None for c in coders)
    assert clients[0].segments > 1 if mtu else clients[0].segments == 1
    assert (len(decoded) == 0) == pumped  # the pump decodes in C, the Python loop here
    for step in range(2):
        want = run_round(bfp, inputs, step=step, partition_elements=partition).average
        for w in range(workers):
            assert torch.equal(outputs[w][step], want), (step, w)
    counts = [d.statistics()["daemon"] for d in daemons]
    lost = sum(c["injected_dropped_in"] + c["injected_dropped_out"] for c in counts)
    assert lost > 10  # ~300 packets a daemon: their packets were resent


def test_a_route_whose_coder_the_pump_does_not_have_is_refused():
    layout = ChunkLayout(lanes=16, lanes_per_chunk=8, in_bits=32, out_bits=32)
    data = np.zeros(16, dtype=np.int32)
    transfer = Transfer(job=1, worker=0, op=Op.SUM, first_chunk=0, slots=1, max_contributors=1,
                        buffers=LaneBuffers(layout, memoryview(data).cast("B"),
                                            memoryview(data).cast("B")))  # fmt: skip
    routes = pump.Routes([(JobHandle(("127.0.0.1", 5), 1, 0, 1, 8, 1), transfer)])
    routes.table["codec"] = 2  # no such coder: nothing is encoded, decoded or sent
    with open_socket(("127.0.0.1", 0)) as sock:
        with pytest.raises(ValueError, match="route 0: codec 2"):
            routes.receive([sock.fileno()], 0.0)
        with pytest.raises(ValueError, match="route 0: codec 2"):
            routes.send(sock.fileno(), [(0, 0)])


def test_an_ipv6_or_payload_transfer_keeps_the_python_loop():
    layout = ChunkLayout(lanes=8, lanes_per_chunk=8, in_bits=32, out_bits=32)
    data = memoryview(bytearray(32))
    transfer = Transfer(job=1, worker=0, op=Op.SUM, first_chunk=0, slots=1,
                        buffers=LaneBuffers(layout, data, data), max_contributors=1)  # fmt: skip
    assert not pump.serves([(JobHandle(("::1", 5), 1, 0, 1, 8, 1), transfer)])
    assert pump.serves([(JobHandle(("127.0.0.1", 5), 1, 0, 1, 8, 1), transfer)])


def segmented_transfer(segments: int = 3):
    """36 lanes in packets of 8, three packets per chunk: chunks 10 (packets 0-2) and 11
    (packets 3-4, the last one of 4 lanes); the aggregator's packet ids start at 30."""
    layout = ChunkLayout(lanes=36, lanes_per_chunk=8 * segments, in_bits=32, out_bits=32)
    up = np.arange(36, dtype=np.int32)
    down = np.zeros(36, dtype=np.int32)
    buffers = LaneBuffers(layout, memoryview(up).cast("B"), memoryview(down).cast("B"))
    transfer = Transfer(job=2, worker=0, op=Op.SUM, first_chunk=10, slots=2, buffers=buffers,
                        max_contributors=2, segments=segments, first_packet=30)  # fmt: skip
    return transfer, up, down


def test_a_chunk_of_several_packets_goes_in_one_send_and_is_placed_once_all_are_in():
    transfer, _up, down = segmented_transfer()
    with open_socket(("127.0.0.1", 0)) as worker, open_socket(("127.0.0.1", 0)) as switch:
        job = JobHandle(switch.getsockname(), 2, 0, 2, 8, 2, segments=3)
        routes = pump.Routes([(job, transfer)])
        routes.send(worker.fileno(), [(0, 10), (0, 11)])
        switch.settimeout(2)
        packets = [switch.recvfrom(1 << 16)[0] for _ in range(5)]  # GSO cut them apart
        slots = 2 * 3  # the aggregator's: one per packet of the window
        for i, data in enumerate(packets):
            packet, lanes = 30 + i, 8 if i < 4 else 4
            want = Header(Kind.DATA, 2, 0, packet % slots, (packet // slots) % 2, Op.SUM, 0,
                          packet, lanes, 1)  # fmt: skip
            assert data[:HEADER_SIZE] == want.pack()
            lanes_sent = np.frombuffer(data[HEADER_SIZE:], np.int32).tolist()
            assert lanes_sent == list(range(8 * i, 8 * i + lanes))

        def result(packet, lanes=8):
            header = Header(Kind.RESULT, 2, ANY_WORKER, packet % slots, (packet // slots) % 2,
                            Op.SUM, 0, packet, lanes, 2)  # fmt: skip
            return header.pack() + np.full(lanes, packet, np.int32).tobytes()

        for packet in (30, 31, 33):  # chunk 10 lacks packet 32, chunk 11 packet 34
            switch.sendto(result(packet), worker.getsockname())
        # no chunk is complete; each placed packet is progress (loss detection counts it)
        assert drain(routes, worker) == [(0, 10, 2, 0, pump.PROGRESS)] * 2 + [
            (0, 11, 2, 0, pump.PROGRESS)
        ]
        routes.send(worker.fileno(), [(0, 10), (0, 11)])  # resends repeat only missing packets
        resent = sorted(parse_header(switch.recvfrom(1 << 16)[0]).chunk for _ in range(2))
        assert resent == [32, 34]
        switch.sendto(result(34, lanes=4), worker.getsockname())
        switch.sendto(result(32), worker.getsockname())
        assert drain(routes, worker) == [(0, 11, 2, 0, pump.PLACED), (0, 10, 2, 0, pump.PLACED)]
        assert down.tolist() == [30] * 8 + [31] * 8 + [32] * 8 + [33] * 8 + [34] * 4


def test_a_chunks_last_packet_with_packets_missing_before_it_reports_holes():
    transfer, _up, down = segmented_transfer()
    with open_socket(("127.0.0.1", 0)) as worker, open_socket(("127.0.0.1", 0)) as switch:
        job = JobHandle(switch.getsockname(), 2, 0, 2, 8, 2, segments=3)
        routes = pump.Routes([(job, transfer)])
        slots = 6

        def result(packet, lanes=8):
            header = Header(Kind.RESULT, 2, ANY_WORKER, packet % slots, (packet // slots) % 2,
                            Op.SUM, 0, packet, lanes, 2)  # fmt: skip
            return header.pack() + np.full(lanes, packet, np.int32).tobytes()

        # chunk 10 is packets 30-32, chunk 11 packets 33-34; 31 and 33 never came
        for packet, lanes in ((30, 8), (32, 8), (34, 4)):
            switch.sendto(result(packet, lanes), worker.getsockname())
        assert drain(routes, worker) == [
            (0, 10, 2, 0, pump.PROGRESS),
            (0, 10, 2, 0, pump.HOLES),  # its last packet, one before it missing: lost
            (0, 11, 2, 0, pump.HOLES),
        ]
        routes.send(worker.fileno(), [(0, 10), (0, 11)])  # the resends: only the holes
        resent = sorted(parse_header(switch.recvfrom(1 << 16)[0]).chunk for _ in range(2))
        assert resent == [31, 33]
        switch.sendto(result(31), worker.getsockname())
        switch.sendto(result(33), worker.getsockname())
        assert drain(routes, worker) == [(0, 10, 2, 0, pump.PLACED), (0, 11, 2, 0, pump.PLACED)]
        assert down.tolist() == [30] * 8 + [31] * 8 + [32] * 8 + [33] * 8 + [34] * 4


def drain(routes, sock) -> list:
    events = []
    for _ in range(5):
        events += routes.receive([sock.fileno()], 0.05)
    return events


def test_chunks_of_several_packets_need_the_pump(monkeypatch):
    monkeypatch.setenv("GRADSUM_PUMP", "0")
    transfer, _, _ = segmented_transfer()
    job = JobHandle(("127.0.0.1", 5), 2, 0, 2, 8, 2, segments=3)
    with pytest.raises(RuntimeError, match="native pump"):
        pump.serves([(job, transfer)])


def test_a_run_of_results_joined_by_gro_lands_in_place_and_others_are_moved_to_theirs():
    transfer, _up, down = segmented_transfer()
    with open_socket(("127.0.0.1", 0)) as worker, open_socket(("127.0.0.1", 0)) as switch:
        if not enable_gro(worker):
            pytest.skip("this kernel has no UDP_GRO")
        job = JobHandle(switch.getsockname(), 2, 0, 2, 8, 2, segments=3)
        routes = pump.Routes([(job, transfer)])
        slots = 6

        def result(packet, lanes=8, value=None):
            header = Header(Kind.RESULT, 2, ANY_WORKER, packet % slots, (packet // slots) % 2,
                            Op.SUM, 0, packet, lanes, 2)  # fmt: skip
            return header.pack() + np.full(lanes, packet if value is None else value,
                                           np.int32).tobytes()  # fmt: skip

        def send_run(*datagrams):  # one GSO send: the worker's kernel keeps them joined
            size = struct.pack("H", len(datagrams[0]))
            switch.sendmsg([b"".join(datagrams)], [(socket.SOL_UDP, 103, size)], 0,
                           worker.getsockname())  # fmt: skip

        # after 31 the pump expects 32; 33 came (answers to resends need not be consecutive):
        # it landed in 32's place, still waiting, and is moved to its own
        send_run(result(31), result(33))
        assert drain(routes, worker) == [(0, 10, 2, 0, pump.PROGRESS), (0, 11, 2, 0, pump.PROGRESS)]
        send_run(result(30), result(32))
        assert drain(routes, worker) == [(0, 10, 2, 0, pump.PLACED)]
        # after 33 the pump expects 34 (4 lanes); a repeat of 32 came instead: reported, and
        # neither 34's place nor 32's (already placed) takes its payload
        send_run(result(33, value=-1), result(32, value=-1))
        assert drain(routes, worker) == [(0, 11, 2, 0, pump.REPEAT), (0, 10, 2, 0, pump.REPEAT)]
        send_run(result(34, lanes=4))
        assert drain(routes, worker) == [(0, 11, 2, 0, pump.PLACED)]
        assert down.tolist() == [30] * 8 + [31] * 8 + [32] * 8 + [33] * 8 + [34] * 4


@pytest.mark.parametrize("path", ["pump", "python"])
def test_a_worker_places_only_results_that_carry_its_jobs_token(path, monkeypatch):
    """A forged result from the aggregator's address (an off-path spoofer) lacks the job's
    token: neither receive path places it or counts it, and the real one is placed."""
    from gradsum.net.client import UdpTransport

    if path == "python":
        monkeypatch.setenv("GRADSUM_PUMP", "0")
    token = 0x1234_5678_9ABC_DEF0
    with open_socket(("127.0.0.1", 0)) as worker, open_socket(("127.0.0.1", 0)) as switch:
        layout = ChunkLayout(lanes=8, lanes_per_chunk=8, in_bits=32, out_bits=32)
        up, down = np.arange(8, dtype=np.int32), np.zeros(8, dtype=np.int32)
        buffers = LaneBuffers(layout, memoryview(up).cast("B"), memoryview(down).cast("B"))
        transfer = Transfer(job=7, worker=0, op=Op.SUM, first_chunk=0, slots=1, buffers=buffers,
                            max_contributors=2, token=token)  # fmt: skip
        job = JobHandle(switch.getsockname(), 7, 0, 1, 8, 2, token=token)
        assert pump.serves([(job, transfer)]) == (path == "pump")
        target = worker.getsockname()
        for forged in (0, token ^ 1):
            header = Header(Kind.RESULT, 7, ANY_WORKER, 0, 0, Op.SUM, 0, 0, 8, 2, forged)
            switch.sendto(header.pack() + np.full(8, -1, np.int32).tobytes(), target)
        real = Header(Kind.RESULT, 7, ANY_WORKER, 0, 0, Op.SUM, 0, 0, 8, 2, token)
        switch.sendto(real.pack() + np.full(8, 5, np.int32).tobytes(), target)
        UdpTransport(worker, wait_limit=5).run([(job, transfer)])
        assert transfer.done and down.tolist() == [5] * 8
        assert transfer.stream.stats.duplicate_results == 0
        sent = Header.pack(Header(Kind.DATA, 7, 0, 0, 0, Op.SUM, 0, 0, 8, 1, token))
        switch.settimeout(2)
        assert switch.recv(1 << 16)[:HEADER_SIZE] == sent  # the worker's packet carries it


def test_a_run_of_placed_results_is_accepted_as_its_results_one_by_one():
    """The pump loop hands a transfer each run of its placed results at once
    (``Transfer.accept_placed``): the contributors, the partial flag and the chunks to send are
    those of ``accept`` result by result. Fails with a run that records one count for all, or
    drops a later result's flag."""
    from gradsum.dataplane.packet import PARTIAL

    def transfer():
        layout = ChunkLayout(lanes=80, lanes_per_chunk=8, in_bits=32, out_bits=32)
        up, down = np.zeros(80, np.int32), np.zeros(80, np.int32)
        buffers = LaneBuffers(layout, memoryview(up).cast("B"), memoryview(down).cast("B"))
        buffers.coded_natively = True
        made = Transfer(job=7, worker=1, op=Op.SUM, first_chunk=4, slots=3, buffers=buffers,
                        max_contributors=3)  # fmt: skip
        made.start(0.0)
        return made

    placed = pump.PLACED
    runs = [[(0, 4, 3, 0, placed), (0, 5, 2, PARTIAL, placed)],
            [(0, 6, 3, 0, placed), (0, 7, 1, PARTIAL, placed), (0, 8, 3, 0, placed)]]  # fmt: skip
    one, many = transfer(), transfer()
    for k, run in enumerate(runs):
        singly = [c for _, chunk, n, flags, _ in run for c in one.accept(chunk, n, flags, 0, k)]
        assert many.accept_placed(run, k) == singly
        assert many.contributors.tolist() == one.contributors.tolist()
        assert many.partial == one.partial
    assert one.contributors.tolist()[:5] == [3, 2, 3, 1, 3] and one.partial
