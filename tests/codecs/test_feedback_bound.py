"""Error feedback's bound: after a gradient spike the memory added is at most ``feedback_bound``
times the new gradient's norm; in steady state the bound never acts."""

import pytest
import torch

from gradsum.codecs import make_codec, native_common, nmse, run_round
from gradsum.codecs.base import CodecContext
from gradsum.codecs.feedback import ErrorFeedback, TransformedErrorFeedback
from gradsum.codecs.round import PARTITION_ELEMENTS

from .conftest import gaussian_inputs

UNBOUNDED = float("inf")


@pytest.mark.parametrize("name", ["thc", "thc-uniform"])
def test_in_steady_state_the_bound_changes_no_bit(name):
    """THC's memory is a fraction of the gradient's norm, so it is added whole: the same
    payloads. (TopK's is not: it holds the coordinates not yet sent, often more than the
    gradient, so a bound of 1 acts on every step there.)"""
    bounded = make_codec(name, workers=4, error_feedback=True)
    assert bounded.bound == 1.0  # THC's own
    plain = make_codec(name, workers=4, feedback_bound=UNBOUNDED, error_feedback=True)
    assert plain.bound is None
    for step in range(6):
        inputs = gaussian_inputs(4, 3000, seed=step)
        a, b = run_round(bounded, inputs, step=step), run_round(plain, inputs, step=step)
        assert torch.equal(a.average, b.average), step
    assert any(float(m.norm()) > 0 for m in bounded.memory.values())


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
@pytest.mark.parametrize("kind", [TransformedErrorFeedback, ErrorFeedback])
def test_after_a_spike_the_memory_added_is_scaled_to_the_bound(kind, native, monkeypatch):
    monkeypatch.setenv("GRADSUM_NATIVE", native)
    codec = make_codec("thc", workers=1, feedback_bound=0.5, error_feedback=True)
    if kind is ErrorFeedback:
        codec = ErrorFeedback(codec.inner, 0.5)
    spike = 100 * gaussian_inputs(1, 4096, seed=1)[0]
    run_round(codec, [spike])
    ((key, memory),) = codec.memory.items()
    ctx = CodecContext(worker=key[0], step=1, key=key[1])
    assert ctx.state_key == key
    assert float(memory.norm()) > 10 * float(spike.norm()) / 100  # the spike's error is large
    x = gaussian_inputs(1, 4096, seed=2)[0]
    plain = x if kind is ErrorFeedback else codec.inner.transform(x, ctx)
    added = codec.precondition(x, ctx) - plain
    assert float(added.norm()) == pytest.approx(0.5 * float(x.norm()), rel=1e-4)
    # the direction is the memory's
    cosine = float(torch.nn.functional.cosine_similarity(added, memory, dim=0))
    assert cosine == pytest.approx(1.0, abs=1e-5)


def test_the_bound_takes_a_spike_out_of_the_next_rounds_at_a_realistic_size():
    """Three 2^20 partitions and a ragged one; all four workers spike 100x for one round.
    Unbounded, the next round adds that round's quantization error (norms ~ the spike's) to
    gradients 100x smaller; bounded, the next rounds' error is the steady state's.

    On the torch path (GRADSUM_NATIVE=0, ten times slower) the partitions are 2^13: the same
    three whole ones and a ragged one, each encoded, bounded and fed back alike."""
    native = native_common.enabled()
    partition, ragged = (PARTITION_ELEMENTS, 12_345) if native else (1 << 13, 1_234)
    length = 3 * partition + ragged
    generator = torch.Generator().manual_seed(7)

    def draw(scale=1.0):
        return [scale * torch.randn(length, generator=generator) for _ in range(4)]

    rounds = [draw(100.0), draw(), draw(), draw()]
    errors = {}
    for bound in (UNBOUNDED, 1.0):
        codec = make_codec("thc", workers=4, feedback_bound=bound, error_feedback=True)
        errors[bound] = [nmse(run_round(codec, xs, step=s, partition_elements=partition).average,
                              xs) for s, xs in enumerate(rounds)]  # fmt: skip
    steady = make_codec("thc", workers=4, feedback_bound=UNBOUNDED, error_feedback=True)
    reference = [nmse(run_round(steady, xs, step=s, partition_elements=partition).average, xs)
                 for s, xs in enumerate(rounds[1:])][-1]  # fmt: skip
    assert errors[UNBOUNDED][0] == errors[1.0][0]  # the spike round itself: nothing to bound yet
    assert errors[UNBOUNDED][1] > 1000 * reference  # the spike's error, fed back whole
    assert errors[1.0][1] < 0.05 * errors[UNBOUNDED][1]
    assert errors[1.0][3] < 3 * reference  # back to the steady state's error


@pytest.mark.parametrize("bound", [0, -1.0, float("nan"), "1"])
def test_a_bound_is_a_positive_finite_factor(bound):
    with pytest.raises(ValueError, match="feedback_bound"):
        make_codec("thc", workers=2, feedback_bound=bound, error_feedback=True)


def test_a_bound_needs_error_feedback():
    with pytest.raises(ValueError, match="runs without error feedback"):
        make_codec("thc", workers=2, error_feedback=False, feedback_bound=1.0)
    with pytest.raises(ValueError, match="keeps its own error feedback"):
        make_codec("powersgd", workers=2, feedback_bound=1.0)
    # a command line's options: parsed like the others
    from gradsum.codecs.registry import parse_options

    codec = make_codec("thc", workers=2, **parse_options("error_feedback=true,feedback_bound=0.5"))
    assert codec.bound == 0.5
