"""THC's policy for models it was not tuned on: each described tensor rounded at its own scale,
and no error feedback unless asked for.

The failure these pin: one scale per partition lets the tensor with the largest gradients (a
token embedding) set every other tensor's error, so a tensor with 10x smaller gradients gets
noise larger than its signal; under Adam that noise becomes full-size steps and training stalls
(docs/benchmarks.md, "Codec quality across models")."""

import pytest
import torch

from gradsum.codecs import ErrorFeedback, make_codec, run_round
from gradsum.train.loop import task_loss
from gradsum.train.models import build_model

# tensors of very different scales in one partition, as a model's fusion group holds them
SHAPES = [(256, 48), (48,), (48, 144), (144,), (48, 48), (48,)]
SCALES = [1.0, 1e-3, 0.02, 0.5, 3e-3, 10.0]


def _inputs(workers: int, seed: int, factors=None) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    factors = factors or [1.0] * len(SHAPES)
    out = []
    for _ in range(workers):
        parts = [
            scale * factor * (0.5 + torch.randn(torch.Size(shape).numel(), generator=generator))
            for shape, scale, factor in zip(SHAPES, SCALES, factors, strict=True)
        ]
        out.append(torch.cat(parts))
    return out


def _per_tensor(values: torch.Tensor) -> list[torch.Tensor]:
    sizes = [torch.Size(shape).numel() for shape in SHAPES]
    return list(values.split(sizes))


def _relative_errors(average, inputs) -> list[float]:
    true = torch.stack(inputs).mean(0)
    return [float((a - t).norm() / t.norm())
            for a, t in zip(_per_tensor(average), _per_tensor(true), strict=True)]  # fmt: skip


def _round(codec, inputs, step=0, partition=1 << 20):
    codec.describe("group", SHAPES)
    return run_round(codec, inputs, key="group", step=step, partition_elements=partition).average


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
@pytest.mark.parametrize("correlated", [False, True])
def test_every_tensor_gets_an_error_proportional_to_its_own_gradient(native, correlated,
                                                                      monkeypatch):  # fmt: skip
    """4 workers, six tensors whose scales span 10^4 in one partition: with tensor scales each
    tensor's error is THC's usual fraction of its own average; with the paper's one scale the
    small ones are lost in the large one's noise."""
    monkeypatch.setenv("GRADSUM_NATIVE", native)
    inputs = _inputs(4, seed=1)
    spec = {"correlated": correlated, "error_feedback": False}
    errors = _relative_errors(_round(make_codec("thc", workers=4, **spec), inputs), inputs)
    assert max(errors) < 0.2, errors
    paper = make_codec("thc", workers=4, scales="partition", **spec)
    paper_errors = _relative_errors(_round(paper, inputs), inputs)
    assert paper_errors[1] > 20 * errors[1], (paper_errors, errors)


def test_a_tensor_scaled_on_every_worker_comes_back_scaled():
    """Per-tensor equivariance: multiply tensor s on every worker by c_s and its average is
    c_s times the first one's, to float rounding (same random draws). A scale dropped at the
    decode, or applied twice, breaks it."""
    inputs = _inputs(4, seed=2)
    factors = [8.0, 0.25, 1.0, 64.0, 2.0**-10, 0.5]
    scaled = _inputs(4, seed=2, factors=factors)
    first = _per_tensor(_round(make_codec("thc", workers=4, error_feedback=False), inputs))
    second = _per_tensor(_round(make_codec("thc", workers=4, error_feedback=False), scaled))
    for a, b, c in zip(first, second, factors, strict=True):
        torch.testing.assert_close(b, c * a, rtol=1e-4, atol=1e-6 * float(b.abs().max()))


def test_partitions_cut_through_tensors_keep_the_pieces_scales():
    """A partition boundary inside a tensor: each piece is scaled in its own partition, and the
    result matches the error of one large partition."""
    inputs = _inputs(4, seed=3)
    codec = make_codec("thc", workers=4, error_feedback=False)
    errors = _relative_errors(_round(codec, inputs, partition=5000), inputs)
    assert max(errors) < 0.2, errors
    assert len({k for k in codec._segments if k[0] == "group"}) == -(-len(inputs[0]) // 5000)


def test_an_undescribed_buffer_keeps_one_scale_per_partition():
    """Nothing described: THC is the paper's, bit for bit."""
    inputs = _inputs(4, seed=4)
    tensor = run_round(make_codec("thc", workers=4, error_feedback=False), inputs).average
    paper = make_codec("thc", workers=4, error_feedback=False, scales="partition")
    assert torch.equal(tensor, run_round(paper, inputs).average)


def test_a_description_that_does_not_cover_the_buffer_is_refused():
    codec = make_codec("thc", workers=2, error_feedback=False)
    codec.describe("group", [(10,), (20,)])
    with pytest.raises(ValueError, match="hold 30 coordinates"):
        run_round(codec, [torch.ones(31), torch.ones(31)], key="group")


def test_tensor_scales_under_error_feedback_keep_the_memory_in_the_gradients_domain():
    """With error feedback on (SGD), the wrapper passes the tensors to THC and the memory is
    the gradient minus what this worker's payload decodes to, tensor by tensor."""
    codec = make_codec("thc", workers=2, error_feedback=True)
    assert isinstance(codec, ErrorFeedback)
    inputs = _inputs(2, seed=5)
    errors = _relative_errors(_round(codec, inputs), inputs)
    assert max(errors) < 0.3, errors
    memory = codec.memory[(0, ("group", 0))]
    assert memory.numel() == inputs[0].numel()
    for piece, x in zip(_per_tensor(memory), _per_tensor(inputs[0]), strict=True):
        assert float(piece.norm()) < 0.6 * float(x.norm())


def test_thc_sends_without_error_feedback_unless_asked():
    """Its rounding is unbiased; feedback doubled the noise a step receives and slowed AdamW and
    destabilised SGD on a GPT. What the user asks for wins."""
    assert not isinstance(make_codec("thc", workers=2), ErrorFeedback)
    assert isinstance(make_codec("thc", workers=2, error_feedback=True), ErrorFeedback)
    # codecs whose compression is biased keep theirs
    assert isinstance(make_codec("topk", workers=2), ErrorFeedback)


def _gpt_gradients(workers: int, seed: int) -> tuple[list[tuple[int, ...]], list[torch.Tensor]]:
    """The shapes and every worker's flat gradient of the GPT shape THC once stalled on (6 layers,
    width 192, context 64), one byte sequence per worker, after 20 AdamW steps on fp32 averages:
    a token embedding whose gradients are 10-100x the other tensors'."""
    torch.manual_seed(seed)
    model = build_model("gpt", 256, layers=6, width=192, heads=4, context=64)
    parameters = list(model.parameters())
    optimizer = torch.optim.AdamW(parameters, lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(97, 123, (20_000,), generator=generator)  # lower-case bytes

    def gradients():
        flats = []
        for _ in range(workers):
            start = int(torch.randint(0, len(text) - 65, (1,), generator=generator))
            window = text[start : start + 65]
            model.zero_grad(set_to_none=True)
            task_loss(model(window[None, :-1]), window[None, 1:]).backward()
            flats.append(torch.cat([p.grad.reshape(-1) for p in parameters]))
        return flats

    for _ in range(20):
        average = torch.stack(gradients()).mean(0)
        offset = 0
        for p in parameters:
            p.grad = average[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer.step()
    return [tuple(p.shape) for p in parameters], gradients()


@pytest.mark.slow
def test_no_tensor_of_a_gpt_gets_more_noise_than_signal():
    """The stall's cause at the size users run: a fusion group of all 2.7M parameters. With the
    default every tensor's error stays a fraction of its own average gradient; with the paper's
    one scale the token embedding sets everybody's noise and some tensors get more noise than
    signal (the test bites: it fails if the default regresses to one scale)."""
    shapes, flats = _gpt_gradients(4, seed=7)
    sizes = [torch.Size(shape).numel() for shape in shapes]
    true = torch.stack(flats).mean(0)

    def noise_to_signal(**options) -> list[float]:
        codec = make_codec("thc", workers=4, **options)
        codec.describe("model", shapes)
        average = run_round(codec, flats, key="model", step=3).average
        return [float((a - t).norm() / t.norm())
                for a, t in zip(average.split(sizes), true.split(sizes), strict=True)]  # fmt: skip

    assert max(noise_to_signal()) < 0.5
    assert max(noise_to_signal(scales="partition")) > 2.0
