"""Whole codec rounds through the data plane over an in-memory lossy network (no sockets)."""

import pytest
import torch

from gradsum.codecs import make_codec, nmse, run_round
from gradsum.codecs import round as round_module
from gradsum.codecs.round import CodecRound, run_quorum_round
from gradsum.dataplane import (
    AggregationTimeout,
    Collective,
    DataPlane,
    JobHandle,
    JobSpec,
    Op,
    RetryPolicy,
    parse_header,
    server_profile,
    switch_profile,
)
from gradsum.dataplane.codec_wire import wire_format
from gradsum.dataplane.transfer import LaneBuffers

from .memnet import Faults, MemoryNetwork

POLICY = RetryPolicy(timeout=0.002, max_timeout=0.02, give_up_after=5.0)


def worker_address(w):
    return ("10.0.1.1", 5000 + w)


def inputs_for(workers, length, seed=0):
    return [
        torch.randn(length, generator=torch.Generator().manual_seed(seed + w))
        for w in range(workers)
    ]


def allreduce_over(network, aggregators, name, inputs, *, slots=4, elements=256, steps=1,
                   options=None, job=1, quorum=0, deadline=0.0, present=None, streaming=True,
                   partition_elements=None):  # fmt: skip
    """Register one job per aggregator, run every worker's round(s); return the outputs."""
    workers = len(inputs)
    codec = make_codec(name, workers=workers, **(options or {}))
    fmt = wire_format(codec, options)
    addresses = tuple(worker_address(w) for w in range(workers))
    for address, aggregator in aggregators.items():
        spec = JobSpec(job, addresses, slots, elements, fmt.op, quorum=quorum, deadline=deadline)
        aggregator.register(spec)
        network.add_aggregator(address, aggregator)

    def worker(w):
        own = make_codec(name, workers=workers, **(options or {}))
        handles = [JobHandle(a, job, w, slots, elements, workers) for a in aggregators]
        collective = Collective(fmt, handles, network.transport(addresses[w]), policy=POLICY,
                                streaming=streaming)  # fmt: skip
        size = collective.partition_size(partition_elements)
        round_ = CodecRound(own, 0, size)
        outputs = [round_.run(inputs[w], collective, worker=w, key=None, step=s)
                   for s in range(steps)]  # fmt: skip
        return outputs, collective.stats

    present = range(workers) if present is None else present
    return network.run_workers({addresses[w]: (lambda w=w: worker(w)) for w in present})


def one_switch():
    return {("10.0.0.1", 48864): DataPlane(switch_profile())}


@pytest.mark.parametrize("name", ["bfp", "thc", "thc-uniform"])
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "whole"])
def test_switch_allreduce_equals_the_in_process_round(name, workers, streaming):
    inputs = inputs_for(workers, 3000)
    expected = run_round(make_codec(name, workers=workers), inputs).average
    results = allreduce_over(MemoryNetwork(), one_switch(), name, inputs, streaming=streaming)
    assert len(results) == workers
    for outputs, _ in results.values():
        assert torch.equal(outputs[0], expected)


FAULTS = [
    Faults(drop=0.1),
    Faults(duplicate=0.2, jitter=0.003),
    Faults(drop=0.05, duplicate=0.1, jitter=0.003),
]


@pytest.mark.parametrize("name", ["bfp", "thc"])
@pytest.mark.parametrize("faults", FAULTS, ids=["loss", "duplicates+reorder", "all"])
def test_loss_duplicates_and_reordering_give_bit_identical_results(name, faults):
    inputs = inputs_for(4, 5000)
    clean = allreduce_over(MemoryNetwork(), one_switch(), name, inputs, steps=2)
    network = MemoryNetwork(seed=3, up=faults, down=faults)
    lossy = allreduce_over(network, one_switch(), name, inputs, steps=2)
    retransmitted = 0
    for address, (outputs, stats) in lossy.items():
        for got, want in zip(outputs, clean[address][0], strict=True):
            assert torch.equal(got, want)
        retransmitted += sum(s.retransmissions + s.duplicate_results for s in stats.values())
    assert retransmitted > 0  # the faults did happen


def test_partitions_spread_over_several_aggregators():
    inputs = inputs_for(3, 4000)
    expected = run_round(make_codec("bfp", workers=3), inputs).average
    aggregators = {("10.0.0.1", p): DataPlane(switch_profile()) for p in (1, 2, 3)}
    results = allreduce_over(
        MemoryNetwork(seed=1, up=Faults(drop=0.05)), aggregators, "bfp", inputs
    )
    for outputs, stats in results.values():
        assert torch.equal(outputs[0], expected)
        assert all(s.results > 0 for s in stats.values())  # every shard carried chunks


@pytest.mark.parametrize("name", ["none", "topk", "terngrad"])
def test_server_allreduce_for_float_and_decoding_codecs(name):
    inputs = inputs_for(3, 3000)
    server = {("10.0.0.9", 1): DataPlane(server_profile())}
    results = allreduce_over(MemoryNetwork(seed=2, up=Faults(drop=0.05)), server, name, inputs,
                             elements=1024)  # fmt: skip
    outputs = [r[0][0] for r in results.values()]
    assert all(torch.equal(o, outputs[0]) for o in outputs)
    # the server's decode-sum-encode, re-encoding with the round's own randomness, is the
    # reference's definition bit for bit (pieces of one packet's 1024 coordinates)
    reference = run_round(make_codec(name, workers=3), inputs, partition_elements=1024).average
    assert torch.equal(outputs[0], reference)
    if name != "none":
        assert nmse(outputs[0], inputs) > 0  # compressed: a server returning fp32 would fail


def test_a_dead_aggregator_gives_a_timeout_that_names_the_chunk():
    network = MemoryNetwork(up=Faults(drop=1.0))
    with pytest.raises(AggregationTimeout, match=r"no result for chunk 0 .* 10\.0\.0\.1:48864"):
        allreduce_over(network, one_switch(), "bfp", inputs_for(2, 100))


@pytest.mark.parametrize("name", ["bfp", "none"])
def test_partial_aggregation_completes_without_a_missing_worker(name):
    inputs = inputs_for(3, 2000)
    aggregators = one_switch() if name == "bfp" else {("10.0.0.9", 1): DataPlane(server_profile())}
    results = allreduce_over(MemoryNetwork(), aggregators, name, inputs, quorum=2, deadline=0.01,
                             present=[0, 1])  # fmt: skip
    expected = (inputs[0] + inputs[1]) / 2
    for outputs, _ in results.values():
        assert torch.allclose(outputs[0], expected, atol=1e-6)
    (aggregator,) = aggregators.values()
    assert aggregator.jobs[1].pool.stats["completed"] > 0


def test_thc_in_waves_gives_the_bits_of_the_in_process_round_at_realistic_size():
    # several 2**20 partitions and a tail that is no power of two: the streamed round prepares
    # them in waves of 1, 2, ... behind the SUM of earlier ones, each wave with its own MAX
    from gradsum.codecs.round import PARTITION_ELEMENTS, wave_partitions

    length = 3 * PARTITION_ELEMENTS + 12345
    assert wave_partitions(4) == [[0], [1, 2], [3]]
    inputs = inputs_for(2, length, seed=5)
    expected = run_round(make_codec("thc", workers=2), inputs, step=0).average
    results = allreduce_over(MemoryNetwork(), one_switch(), "thc", inputs, slots=16,
                             elements=8192)  # fmt: skip
    for outputs, _ in results.values():
        assert torch.equal(outputs[0], expected)


class LateWorker(MemoryNetwork):
    """Worker ``late``'s first send of every other SUM chunk is lost, so those chunks complete
    at the quorum's deadline without it (its resend comes after and gets the result), the
    others with every worker: one round whose chunks have different quorums."""

    def __init__(self, late, **kwargs):
        super().__init__(**kwargs)
        self.late, self.dropped = worker_address(late), set()

    def _post(self, destination, source, data, faults):
        header = parse_header(data)
        first = (source, header.chunk) not in self.dropped
        if source == self.late and header.op is Op.SUM and header.chunk % 2 == 0 and first:
            self.dropped.add((source, header.chunk))
            return
        super()._post(destination, source, data, faults)


@pytest.mark.parametrize("name", ["thc", "bfp"])
def test_chunks_of_different_quorums_decode_lane_by_lane_as_the_in_process_round(name, monkeypatch):
    """The switch's per-chunk counts reach the decode as each lane's count (THC: its rotated
    lanes, before the inverse rotation; bfp: each chunk decoded with its own count where it
    lands, ``LaneCoder``), giving the in-process quorum round's bits."""
    inputs, delivered, chunks = inputs_for(3, 3000, seed=5), [], []
    original, received = round_module.decode, LaneBuffers.received

    def recording(codec, summed, ctx, shared, out):
        delivered.append((ctx.worker, summed.counts))
        original(codec, summed, ctx, shared, out)

    def counting(buffers, index, nbytes, contributors):
        if buffers.coder is not None:  # the SUM's chunks (not the MAX round's)
            first, count = buffers.layout.lanes_of(index)
            chunks.append((buffers.lane0 + first, count, contributors))
        received(buffers, index, nbytes, contributors)

    monkeypatch.setattr(round_module, "decode", recording)
    monkeypatch.setattr(LaneBuffers, "received", counting)
    # a deadline well inside the resend timer: the lost chunks complete without worker 2
    results = allreduce_over(LateWorker(late=2), one_switch(), name, inputs, quorum=2,
                             deadline=5e-5)  # fmt: skip
    codec = make_codec(name, workers=3)
    if name == "thc":
        counts = {worker: c for worker, c in delivered}
        assert set(counts) == {0, 1, 2} and all(c is not None for c in counts.values())
        lane_counts = counts[0]
        assert all(torch.equal(c, lane_counts) for c in counts.values())
    else:  # the transport decoded every chunk (bfp's lanes are its coordinates)
        assert delivered == []
        lane_counts = torch.zeros(codec.lanes(3000))
        for first, count, contributors in chunks:
            lane_counts[first : first + count] = contributors
        assert len(chunks) == 3 * -(-3000 // 256)  # every chunk, by every worker
    assert set(lane_counts.tolist()) == {2.0, 3.0}  # chunks of both quorums
    mask = torch.ones(3, codec.lanes(3000), dtype=torch.bool)
    mask[2] = lane_counts == 3
    expected = run_quorum_round(codec, inputs, [mask])
    for outputs, _ in results.values():
        assert torch.equal(outputs[0], expected)
    assert not torch.allclose(expected, run_round(codec, inputs).average, atol=1e-3)
