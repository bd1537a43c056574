"""THC's error feedback kept in the rotated domain against the generic wrapper it replaces."""

import pytest
import torch

from gradsum.codecs import make_codec, run_round
from gradsum.codecs.base import CodecContext, aggregator_context
from gradsum.codecs.bits import unpack_bits
from gradsum.codecs.feedback import ErrorFeedback, TransformedErrorFeedback
from gradsum.codecs.thc.codec import THC

from .conftest import gaussian_inputs


def test_thc_runs_its_feedback_in_the_rotated_domain():
    assert isinstance(make_codec("thc", workers=2, error_feedback=True), TransformedErrorFeedback)
    assert type(make_codec("topk", workers=2)) is ErrorFeedback
    with pytest.raises(TypeError, match="no transformed domain"):
        TransformedErrorFeedback(make_codec("topk", error_feedback=False))


def test_same_payloads_as_feedback_in_the_original_domain():
    """R(x + e) = R x + R e: both keep the same error, so over many steps they send the same
    indices except where float rounding of the rotation flips a stochastic rounding decision."""
    rotated, original = TransformedErrorFeedback(THC(workers=2)), ErrorFeedback(THC(workers=2))
    inputs = gaussian_inputs(2, 4096, seed=4)
    for step in range(8):
        a = run_round(rotated, inputs, step=step)
        b = run_round(original, inputs, step=step)
        for mine, theirs in zip(a.payloads, b.payloads, strict=True):
            assert mine.length == theirs.length == 4096
            same = unpack_bits(mine.fields["indices"], 4, 4096) == unpack_bits(
                theirs.fields["indices"], 4, 4096
            )
            assert float(same.double().mean()) > 0.999
        assert torch.allclose(a.average, b.average, atol=1e-3)


def test_padded_tensors_keep_their_memory_in_the_input_domain():
    """With padding the error's padding component would be fed back although the decoder drops
    it (measured: 1.6x the accumulated error of the input-domain memory), so it stays there."""
    codec = make_codec("thc", workers=1, error_feedback=True)
    ctx = CodecContext(key="bias")
    prepared = codec.precondition(torch.randn(1000), ctx)
    assert prepared.shape == (1000,)
    codec.encode(prepared, ctx, codec.summarize(prepared, ctx))
    assert codec.memory[(0, "bias")].shape == (1000,)


def test_memory_is_per_key_shape_checked_and_survives_a_checkpoint():
    codec = make_codec("thc", workers=1, error_feedback=True)
    ctx = CodecContext(key="layer1.weight")
    x = torch.randn(1024)
    prepared = codec.precondition(x, ctx)
    assert not torch.allclose(prepared, x)  # rotated
    payload = codec.encode(prepared, ctx, codec.summarize(prepared, ctx))
    assert payload.length == 1024
    assert codec.memory[(0, "layer1.weight")].shape == (1024,)
    with pytest.raises(ValueError, match="holds 1024 coordinates, the gradient has 64"):
        codec.precondition(torch.randn(64), ctx)
    restored = make_codec("thc", workers=1, error_feedback=True)
    restored.load_state_dict(codec.state_dict())
    assert torch.equal(restored.precondition(x, ctx), codec.precondition(x, ctx))


def test_encode_needs_its_precondition():
    codec = make_codec("thc", workers=1, error_feedback=True)
    with pytest.raises(RuntimeError, match="without its precondition"):
        codec.encode(torch.randn(64), CodecContext(), torch.ones(1))


def test_non_finite_gradient_names_the_original_coordinate():
    codec = make_codec("thc", workers=1, error_feedback=True)
    x = torch.zeros(128)  # a power of two: rotated in precondition
    x[37] = float("nan")
    with pytest.raises(ValueError, match="37"):
        codec.precondition(x, CodecContext())


@pytest.mark.parametrize("block", [None, 1024])
@pytest.mark.pins_native
def test_rotation_with_the_memory_added_matches_torch(monkeypatch, block):
    codec = THC(workers=1, rotation_block=block)
    x, memory = torch.randn(1 << 13), torch.randn(1 << 13)
    results = []
    for enabled in ("1", "0"):
        monkeypatch.setenv("GRADSUM_NATIVE", enabled)
        results.append(codec.transform(x, CodecContext(), add=memory))
    fast, slow = results
    assert float((fast - slow).norm() / slow.norm()) < 1e-6
    monkeypatch.setenv("GRADSUM_NATIVE", "1")
    assert torch.allclose(fast - memory, codec.transform(x, CodecContext()), atol=1e-5)


def test_a_steady_loop_reuses_the_kernels_output_buffers():
    """No fresh multi-MiB tensor per call (each would page-fault on first write): once the
    previous step's outputs are dropped, the next step gets their memory back. The torch path
    (GRADSUM_NATIVE=0, or no C compiler) allocates as torch does."""
    from gradsum.codecs import buffers
    from gradsum.codecs.thc import native

    if not native.available():
        pytest.skip("about the native kernels' outputs: GRADSUM_NATIVE=0 or they are not built")
    codec = make_codec("thc", workers=1, error_feedback=True)
    x = torch.randn(1 << 16)
    addresses = set()
    for step in range(6):
        ctx = CodecContext(step=step)
        w = codec.precondition(x, ctx)
        shared = codec.summarize(w, ctx)
        payload = codec.encode(w, ctx, shared)
        average = codec.decode(codec.aggregate([payload], aggregator_context(ctx)), ctx, shared)
        addresses |= {w.data_ptr(), average.data_ptr()}
        del w, payload, average
    if buffers._BASELINE is not None:  # this torch exposes the reference counts
        assert len(addresses) <= 4  # rotated input, average, error feedback's memory and its next
