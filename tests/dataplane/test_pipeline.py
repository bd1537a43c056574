"""PartwiseRound: bfp encoded and decoded part by part equals the whole, whatever the order."""

import numpy as np
import pytest
import torch

from gradsum.codecs import make_codec
from gradsum.codecs.base import CodecContext, Payload
from gradsum.dataplane.packet import Op
from gradsum.dataplane.pipeline import PartwiseRound
from gradsum.dataplane.transfer import LaneBuffers, Transfer
from gradsum.dataplane.worker import ChunkLayout

CTX = CodecContext(0, 0, 0, 0, None)


def partwise(lanes=5000, per_chunk=40, block=16, slots=3, min_part=200):
    codec = make_codec("bfp", workers=2, block_size=block)
    x = torch.randn(lanes, generator=torch.Generator().manual_seed(1)) * 100
    shared = codec.summarize(x, CTX)
    upstream, result = torch.zeros(lanes, dtype=torch.int32), torch.zeros(lanes, dtype=torch.int32)
    out = torch.full((lanes,), float("nan"))
    layout = ChunkLayout(lanes, per_chunk, 32, 32)
    buffers = LaneBuffers(layout, memoryview(upstream.numpy()).cast("B"),
                          memoryview(result.numpy()).cast("B"))  # fmt: skip
    transfer = Transfer(job=1, worker=0, op=Op.SUM, first_chunk=7, slots=slots, buffers=buffers,
                        max_contributors=2)  # fmt: skip
    work = PartwiseRound(codec, x, shared, upstream, result, out, per_chunk, transfer, min_part)
    return codec, x, shared, upstream, result, out, transfer, work


def test_parts_are_whole_chunks_and_whole_blocks():
    *_, work = partwise(per_chunk=40, block=16, min_part=200)
    assert work.part == 240 and work.parts == -(-5000 // 240)  # lcm(40, 16) = 80, x3 >= 200


@pytest.mark.parametrize("order", ["in order", "reversed"])
def test_streamed_parts_give_the_whole_rounds_bits(order):
    codec, x, shared, upstream, result, out, transfer, work = partwise()
    whole = codec.encode(x, CTX, shared).fields["values"]
    sent = list(transfer.start(0.0))
    assert sent == []  # nothing encoded yet: the window waits
    outstanding, now = [], 0.0
    while not transfer.done:
        now += 1
        if work.pending:
            sent += [c for _, c in work.step(now)]
        outstanding += [c for c in sent if c not in outstanding]
        sent = []
        batch = outstanding if order == "in order" else outstanding[::-1]
        for chunk in batch[:2]:  # the aggregator answers: twice a worker's values
            start, count = transfer.buffers.layout.lanes_of(chunk - transfer.first)
            got = upstream[start : start + count]
            assert torch.equal(got, whole[start : start + count])  # encoded before it left
            result[start : start + count] = got * 2
            outstanding.remove(chunk)
            sent += transfer.accept(chunk, 2, 0, 0, now)
    assert work.finish()
    want = codec.decode(Payload({"values": whole * 2}, x.numel(), 2), CTX, shared)
    assert torch.equal(out, want)
    assert not torch.isnan(out).any()


def test_a_quorum_mixing_counts_leaves_the_decode_to_the_caller():
    *_, transfer, work = partwise(lanes=400, per_chunk=40, block=16, min_part=80)
    for _ in range(work.parts):
        work.step(0.0)
    transfer.contributors[:] = 2
    transfer.contributors[0] = 1
    assert not work.finish()
    assert np.all(transfer.contributors[1:] == 2)
