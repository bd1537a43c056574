"""Quorum decoding: sums whose lanes were summed over different workers (chunks that a switch
completed at its deadline with a quorum) decode with each lane's own count."""

import pytest
import torch

from gradsum.codecs import CODEC_NAMES, make_codec, run_round
from gradsum.codecs.round import decode, run_quorum_round, worker_contexts

from .conftest import gaussian_inputs

LANES_PER_CHUNK = 256


def chunk_mask(workers: int, lanes: int, absent: int) -> torch.Tensor:
    """Every worker on every lane, but ``absent`` missing from every other chunk of lanes."""
    mask = torch.ones(workers, lanes, dtype=torch.bool)
    for start in range(0, lanes, 2 * LANES_PER_CHUNK):
        mask[absent, start : start + LANES_PER_CHUNK] = False
    return mask


LINEAR = [name for name in CODEC_NAMES if make_codec(name).linear_decode]


def test_the_codecs_that_declare_a_linear_decode():
    # every integer- or float-summing codec whose lanes average before anything mixes them
    assert set(LINEAR) == {"none", "bfp", "thc", "thc-uniform", "thc-uniform-unrotated",
                           "powersgd"}  # fmt: skip


@pytest.mark.parametrize("name", [n for n in LINEAR if n not in ("none", "powersgd")])
def test_uniform_counts_decode_as_one_contributor_count(name):
    """Counts that are all c decode as the payload of c contributors (lane by lane vs scalar)."""
    inputs = gaussian_inputs(3, 3000, seed=4)
    codec = make_codec(name, workers=3, error_feedback=False)
    result = run_round(codec, inputs)
    summed, shared = result.aggregate, result.shared
    ctx = worker_contexts(3)[0]
    counts = torch.full((codec.lanes(summed.length),), 3.0)
    out = torch.empty(summed.length)
    decode(codec, type(summed)(summed.fields, summed.length, 1, counts=counts), ctx, shared, out)
    assert torch.allclose(out, result.average, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["thc", "bfp", "thc-uniform-unrotated"])
def test_one_quorum_for_every_lane_is_the_round_of_that_quorum_bit_for_bit(name):
    inputs = gaussian_inputs(4, 5000, seed=1)
    codec = make_codec(name, workers=4, error_feedback=False)
    lanes = codec.lanes(5000)
    mask = torch.ones(4, lanes, dtype=torch.bool)
    mask[2] = False
    got = run_quorum_round(codec, inputs, [mask], step=3)
    want = run_round(codec, inputs, contributors=[0, 1, 3], step=3).average
    assert torch.equal(got, want)


def test_thc_under_a_quorum_is_unbiased_lane_by_lane():
    """The mean of many rounds' decodes (fresh rounding each step) is, in the rotated domain,
    every lane's mean over the workers that contributed to it. Dividing by one count for all
    lanes, or after the inverse rotation, would be off by a quarter on half the lanes."""
    workers, length, trials = 4, 4096, 96  # a power of two: the rotation pads nothing
    generator = torch.Generator().manual_seed(7)
    # norms far apart (and a clamp at p = 1e-4): no coordinate of the smaller workers clamps
    inputs = [torch.randn(length, generator=generator) * (1.0 - 0.15 * w) for w in range(workers)]
    codec = make_codec("thc", workers=workers, p=1e-4, error_feedback=False)
    mask = chunk_mask(workers, codec.lanes(length), absent=3)
    ctx = worker_contexts(1)[0]
    rotated = torch.stack([codec.transform(x, ctx) for x in inputs]).double()
    target = (rotated * mask).sum(dim=0) / mask.sum(dim=0)
    estimates = torch.stack([
        codec.transform(run_quorum_round(codec, inputs, [mask], step=t), ctx).double()
        for t in range(trials)
    ])  # fmt: skip
    mean = estimates.mean(dim=0)
    variance = (estimates - mean).pow(2).sum(dim=1).sum() / (trials - 1)  # over all lanes
    ratio = float((mean - target).pow(2).sum() / (variance / trials))
    # unbiased: the mean's squared error is its variance, ratio ~ 1 (4096 lanes: within 0.8-1.2)
    assert 0.7 < ratio < 1.4, ratio
    # the same lanes divided by all four workers instead: clearly biased
    wrong = target * mask.sum(dim=0) / workers
    assert float((mean - wrong).pow(2).sum() / (variance / trials)) > 50


@pytest.mark.parametrize("name", ["topk", "qsgd", "fp16"])
def test_a_codec_without_a_linear_decode_refuses_counts_naming_itself(name):
    codec = make_codec(name, workers=2)
    result = run_round(codec, gaussian_inputs(2, 1000))
    summed = result.aggregate
    counts = torch.tensor([1.0, 2.0]).repeat_interleave(500)
    mixed = type(summed)(summed.fields, summed.length, 1, summed.meta, counts=counts)
    with pytest.raises(NotImplementedError, match=f"{name} round .* 1..2 workers"):
        decode(codec, mixed, worker_contexts(2)[0], result.shared, torch.empty(1000))


def test_a_quorum_round_needs_a_mask_per_piece_of_the_lanes_shape():
    codec = make_codec("thc", workers=2, error_feedback=False)
    inputs = gaussian_inputs(2, 1000)
    with pytest.raises(ValueError, match=r"\(workers, lanes\) = \(2, 1024\)"):
        run_quorum_round(codec, inputs, [torch.ones(2, 1000, dtype=torch.bool)])
    with pytest.raises(ValueError, match="no worker contributed"):
        run_quorum_round(codec, inputs, [torch.zeros(2, 1024, dtype=torch.bool)])
    with pytest.raises(TypeError, match="'topk' has none to sum"):
        run_quorum_round(make_codec("topk", workers=2), inputs, [])


def test_a_quorum_over_several_partitions_and_a_ragged_tail_is_that_quorums_round():
    """At the size users run: two 2**20 partitions and a tail that is no power of two, one
    mask per piece, worker 2 absent from all of them: the round of the other three, bit for
    bit; absent from every other chunk only, neither that round nor the full one."""
    from gradsum.codecs.round import PARTITION_ELEMENTS, partition_bounds

    length = 2 * PARTITION_ELEMENTS + 12_345
    inputs = gaussian_inputs(4, length, seed=6)
    codec = make_codec("thc", workers=4, error_feedback=False)
    pieces = [codec.lanes(end - start) for start, end in partition_bounds(length)]
    assert len(pieces) == 3
    absent = []
    for lanes in pieces:
        mask = torch.ones(4, lanes, dtype=torch.bool)
        mask[2] = False
        absent.append(mask)
    got = run_quorum_round(codec, inputs, absent, step=1)
    assert torch.equal(got, run_round(codec, inputs, contributors=[0, 1, 3], step=1).average)
    mixed = run_quorum_round(codec, inputs, [chunk_mask(4, lanes, absent=2) for lanes in pieces],
                             step=1)  # fmt: skip
    full = run_round(codec, inputs, step=1).average
    assert not torch.equal(mixed, full) and not torch.equal(mixed, got)
