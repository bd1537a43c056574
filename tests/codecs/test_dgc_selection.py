"""DGC's fixed-size payload sends exactly what its sampled threshold selects."""

import torch

from gradsum.codecs import make_codec
from gradsum.codecs.base import CodecContext


def test_dgc_sends_a_superlevel_set_of_about_its_ratio_and_clears_only_what_it_sent():
    n = 3 * (1 << 20) + 12_345  # several partitions' worth, not a power of two
    x = torch.randn(n, generator=torch.Generator().manual_seed(11))
    codec = make_codec("dgc", workers=4)
    ctx = CodecContext(seed=3, worker=1, step=0, partition=0, key="g")
    velocity = codec.precondition(x, ctx)  # first step: the velocity is the gradient
    payload = codec.encode(velocity, ctx)
    k = codec.kept(n)
    indices = payload.fields["indices"].long()
    values = payload.fields["values"]
    assert indices.numel() == k  # the wire's size is fixed
    sent = values != 0
    chosen, rest = indices[sent], torch.ones(n, dtype=torch.bool)
    rest[chosen] = False
    # what goes out is every coordinate above a magnitude threshold, and only those
    assert x[chosen].abs().min() >= x[rest].abs().max()
    assert torch.equal(values[sent], x[chosen])
    # the sampled threshold estimates the top 10 % (0.3 % of n sampled): within 15 %
    assert 0.85 * k <= chosen.numel() <= k
    # momentum factor masking: what was sent is cleared, nothing else
    momentum, kept_velocity = codec._state[ctx.state_key]
    assert torch.count_nonzero(kept_velocity[chosen]) == 0
    assert torch.equal(kept_velocity[rest], x[rest])
    assert torch.equal(momentum[rest], x[rest])
