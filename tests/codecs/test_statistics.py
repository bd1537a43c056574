"""Statistical properties, with sizes and seeds that make them stable."""

import pytest
import torch

from gradsum.codecs import AGGREGATOR, CodecContext, make_codec, nmse, run_round
from gradsum.codecs.round import worker_contexts

from .conftest import gaussian_inputs

ANALYTIC_THC_NMSE = 0.0203  # rounding variance 0.01307 + clamp error 0.00727, per worker


@pytest.mark.parametrize("workers", [1, 4, 16])
def test_thc_nmse_matches_independent_rounding_analysis(workers):
    inputs = gaussian_inputs(workers, 1 << 18, seed=workers)
    codec = make_codec("thc", workers=workers, error_feedback=False)
    measured = nmse(run_round(codec, inputs).average, inputs)
    assert measured == pytest.approx(ANALYTIC_THC_NMSE / workers, rel=0.10)


@pytest.mark.parametrize("name", ["bfp", "thc-uniform", "thc"])
def test_homomorphism_aggregate_equals_sum_of_individual_contributions(name):
    workers = 4
    codec = make_codec(name, workers=workers, error_feedback=False)
    result = run_round(codec, gaussian_inputs(workers, 5000, seed=2))
    aggregator = CodecContext(worker=AGGREGATOR)
    singles = [codec.aggregate([p], aggregator) for p in result.payloads]
    # exactly in the integer domain: the aggregate is the sum of the individual integers
    summed = sum(_integers(codec, s) for s in singles)
    assert torch.equal(_integers(codec, result.aggregate), summed)
    # and decoding the aggregate gives the average of the individually decoded payloads
    ctx = worker_contexts(1)[0]
    individual = torch.stack([codec.decode(s, ctx, result.shared) for s in singles]).mean(0)
    assert torch.allclose(result.average, individual, rtol=1e-5, atol=1e-6)


def _integers(codec, payload):
    if "values" in payload.fields:  # bfp: int32 sums
        return payload.fields["values"].to(torch.int64)
    from gradsum.codecs.bits import unpack_bits

    op = codec.integer_op()
    return unpack_bits(payload.fields["sums"], op.out_bits, _coordinates(codec, payload)).to(
        torch.int64
    )


def _coordinates(codec, payload):
    return codec._coordinates(payload.length)


def _mean_of_encodings(codec, x, trials):
    """Average decoded value of one worker's input over independent encodings."""
    total = torch.zeros_like(x, dtype=torch.float64)
    single_errors = []
    for step in range(trials):
        estimate = run_round(codec, [x], step=step).average
        total += estimate
        single_errors.append(nmse(estimate, [x]))
    return (total / trials).to(torch.float32), sum(single_errors) / trials


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("thc", {"p": 1e-9}),  # nothing clamped: E[decode] is the input itself
        ("thc-uniform", {}),
        ("qsgd", {}),
        ("terngrad", {}),
    ],
)
def test_unbiased_codecs_average_converges_to_the_input(name, options):
    trials = 400
    x = gaussian_inputs(1, 512, seed=3)[0]
    codec = make_codec(name, workers=1, error_feedback=False, **options)
    mean, single = _mean_of_encodings(codec, x, trials)
    # unbiased and independent across trials: the error of the mean shrinks like 1/trials
    assert nmse(mean, [x]) < 2.0 * single / trials
    assert single > 0


def test_thc_clamping_is_the_only_bias():
    trials = 300
    x = gaussian_inputs(1, 512, seed=4)[0]
    codec = make_codec("thc", workers=1, error_feedback=False)
    mean, single = _mean_of_encodings(codec, x, trials)
    ctx = worker_contexts(1)[0]
    rotation = codec._rotation(x.numel(), ctx, x.device)
    norm = float(torch.linalg.vector_norm(x))
    scale = rotation.padded**0.5 / norm
    t = codec.threshold
    clamped = rotation.inverse(rotation.forward(x).mul_(scale).clamp_(-t, t).div_(scale))
    assert nmse(mean, [clamped]) < 2.0 * single / trials
    assert nmse(mean, [x]) > 5.0 * single / trials  # the clamp bias is real and visible


@pytest.mark.parametrize("name", ["topk", "thc"])
def test_error_feedback_drives_accumulated_error_down(name):
    x = gaussian_inputs(1, 4096, seed=6)[0]

    def running_error(codec, steps):
        total = torch.zeros_like(x)
        errors = []
        for step in range(steps):
            total += run_round(codec, [x], step=step).average
            errors.append(nmse(total / (step + 1), [x]))
        return errors

    with_feedback = running_error(make_codec(name, workers=1, error_feedback=True), 60)
    without = running_error(make_codec(name, workers=1, error_feedback=False), 60)
    assert with_feedback[-1] < with_feedback[4] / 5
    assert with_feedback[-1] < without[-1] / 5


def test_error_feedback_state_is_per_key_and_shape_checked():
    codec = make_codec("topk", workers=1)
    ctx = CodecContext(key="layer1.weight")
    payload = codec.encode(codec.precondition(torch.randn(100), ctx), ctx)
    assert payload.length == 100
    assert set(codec.memory) == {(0, "layer1.weight")}
    with pytest.raises(ValueError, match="holds 100 coordinates, the gradient has 50"):
        codec.precondition(torch.randn(50), ctx)
    other = CodecContext(key="layer2.weight")
    assert codec.precondition(torch.randn(50), other).shape == (50,)
