"""A step's THC rounds as one batch of rows (``thc.step``) give each gradient's own round
(``run_round``) bit for bit, run on the CPU by Triton's interpreter: the row kernels against
the fused kernels of one partition, with tiles shrunk so the cross-tile kernels run (the
interpreter runs a kernel's programs one by one: the sizes are small)."""

import os
import sys

import pytest

# as in test_triton.py: the interpreter must be chosen before triton's first import
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported without TRITON_INTERPRET=1", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch

from gradsum.codecs import make_codec
from gradsum.codecs.base import CodecContext, NonFiniteGradientError, hashed_uniform
from gradsum.codecs.round import CodecRound, run_round, run_step_round
from gradsum.codecs.thc.codec import THC

from .conftest import OneWorker

pytestmark = pytest.mark.pins_native

PARTITION = 1 << 10
# full partitions (rotated memory), a gradient under one partition, and one whose last partition
# is short: rows of two padded lengths, blocks across tiles (of 512) and within one
SIZES = [3 * PARTITION, 700, 2 * PARTITION + 100]
# tensor scales: partitions of two, one and four tensors, and of one tensor's piece
SHAPES = [
    [(PARTITION - 100,), (100,), (PARTITION,), (500,), (PARTITION - 500,)],
    [(700,)],
    [(300,), (400,), (5,), (2 * PARTITION + 100 - 705,)],
]


@pytest.fixture
def fused(monkeypatch):
    """The GPU's path on the CPU: the fused kernels, interpreted, on small tiles."""
    from gradsum.codecs.thc import triton_kernels

    monkeypatch.setenv("GRADSUM_NATIVE", "0")
    monkeypatch.setattr(triton_kernels, "TILE", 512)  # a partition's row: 2 tiles, and the
    monkeypatch.setattr(triton_kernels, "COLUMNS", 256)  # cross-tile stages 2 programs a row
    monkeypatch.setattr(triton_kernels, "use_for", lambda device: True)
    return triton_kernels


def codec_pair(feedback: bool, scales: str, shapes=SHAPES):
    codecs = [make_codec("thc", workers=2, error_feedback=feedback) for _ in range(2)]
    if scales == "tensor":
        for codec in codecs:
            for key, tensors in enumerate(shapes):
                codec.describe(key, tensors)
    return codecs


def gradients(step: int, sizes=SIZES) -> list[list[torch.Tensor]]:
    """Two workers' gradients of very different scales per tensor (tensor scales act)."""
    generator = torch.Generator().manual_seed(step)
    return [[torch.randn(n, generator=generator) * (1 + 10 * g) for g, n in enumerate(sizes)]
            for _ in range(2)]  # fmt: skip


@pytest.mark.slow  # interpreted kernels: scheduled first
@pytest.mark.parametrize("scales", ["partition", "tensor"])
@pytest.mark.parametrize("feedback", [False, True], ids=["no-feedback", "feedback"])
def test_a_batched_step_is_every_gradients_round_bit_for_bit(fused, feedback, scales):
    """The bug it fears: a row that takes another row's scalars, seed, signs, block or memory
    (an offset off by a row), signs of another run's seed, or error feedback's memory carried
    differently by the batch."""
    batched, reference = codec_pair(feedback, scales)
    for step in range(2 if feedback else 1):  # the memory of one step is the next one's
        inputs = gradients(step)
        got = run_step_round(batched, inputs, seed=7, step=step, partition_elements=PARTITION)
        for key, average in enumerate(got):
            want = run_round(reference, [worker[key] for worker in inputs], seed=7, step=step,
                             key=key, partition_elements=PARTITION).average  # fmt: skip
            assert torch.equal(average, want), (step, key)
    if feedback:
        assert batched.memory.keys() == reference.memory.keys()
        for state_key, memory in reference.memory.items():
            assert torch.equal(batched.memory[state_key], memory), state_key


def test_the_step_batches_where_it_says_and_falls_back_with_the_same_values(fused):
    """The bug it fears: a codec the batch does not carry (correlated rounding's strata) run
    through it anyway, or its step giving other values than its rounds."""
    from gradsum.codecs.thc.step import StepRound

    inputs = gradients(0)
    plain = make_codec("thc", workers=2, error_feedback=True)
    assert StepRound.build(plain, inputs[0], worker=0, keys=[0, 1, 2], step=0,
                           partition_elements=PARTITION) is not None  # fmt: skip
    correlated = [make_codec("thc", workers=2, correlated=True) for _ in range(2)]
    assert StepRound.build(correlated[0], inputs[0], worker=0, keys=[0, 1, 2], step=0,
                           partition_elements=PARTITION) is None  # fmt: skip
    got = run_step_round(correlated[0], inputs, partition_elements=PARTITION)
    for key, average in enumerate(got):
        want = run_round(correlated[1], [w[key] for w in inputs], key=key,
                         partition_elements=PARTITION).average  # fmt: skip
        assert torch.equal(average, want)


def test_a_nan_in_a_batched_step_names_its_gradient(fused):
    """The bug it fears: the step's one check (the MAX round's norms) raising a vague error,
    or none, for a NaN coordinate of one gradient among many."""
    inputs = gradients(0)
    inputs[0][2][5] = float("nan")  # worker 0's: the others' rounds see an invalid MAX
    codec = make_codec("thc", workers=2, error_feedback=True)
    with pytest.raises(NonFiniteGradientError, match="first at indices \\[5\\]"):
        run_step_round(codec, inputs, partition_elements=PARTITION)


def test_the_kernels_thresholds_are_the_hashed_draws(fused):
    """The bug it fears: the thresholds a kernel computes from a seed drifting from the torch
    path's (``hashed_uniform``), which the CPU's rounds and the per-partition path draw."""
    codec = THC(workers=3)
    g = codec.granularity
    y = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    seed = CodecContext(seed=1, worker=2, step=3, partition=7).worker_seed()
    assert seed >= 1 << 32  # both halves of the seed are used
    lookups = codec._tables(y.device)
    drawn = fused.quantize(y, hashed_uniform(seed, y.numel()), lookups, 2.5, g / 2, g, 4)
    hashed = fused.quantize(y, seed, lookups, 2.5, g / 2, g, 4)
    assert torch.equal(drawn, hashed)
    draws = hashed_uniform(seed, 1 << 16)
    assert float(draws.min()) >= 0.0 and float(draws.max()) < 1.0
    assert abs(float(draws.mean()) - 0.5) < 0.01  # U[0, 1): 1/sqrt(12 * 2**16) = 0.0011


@pytest.mark.parametrize("counted", [False, True], ids=["sums", "counts-per-lane"])
def test_a_step_through_a_reducer_is_every_gradients_run(fused, counted):
    """The bug it fears: the production entry (``CodecRound.run_many``) placing a row's sum or
    MAX result at another row's, or its row-by-row decode (sums with counts per lane) taking
    other scalars than the batch's."""
    batched, reference = (make_codec("thc", workers=1, error_feedback=True) for _ in range(2))
    for codec in (batched, reference):
        for key, shapes in enumerate(SHAPES):
            codec.describe(key, shapes)
    inputs = gradients(0)[0]
    rounds = CodecRound(batched, seed=5, partition_elements=PARTITION)
    got = rounds.run_many(inputs, OneWorker(counted), worker=0, keys=[0, 1, 2], step=1)
    rounds = CodecRound(reference, seed=5, partition_elements=PARTITION)
    for key, flat in enumerate(inputs):
        want = rounds.run(flat, OneWorker(counted), worker=0, key=key, step=1)
        assert torch.equal(got[key], want), key


# The recorded step's rows, fewer and shorter than the others' (its point is the control flow
# over three steps, not the kernels' sizes): a row of several tensors' pieces (tensor scales,
# memory in the gradient's domain), one of a partition of one tensor (rotated memory) and the
# same gradient's ragged last partition (gradient's domain), blocks across tiles of 128 and
# within one.
SMALL_PARTITION = 256
SMALL_SIZES = [SMALL_PARTITION, SMALL_PARTITION + 44]
SMALL_SHAPES = [[(200,), (56,)], [(SMALL_PARTITION + 44,)]]


@pytest.mark.slow  # interpreted kernels: scheduled first
@pytest.mark.parametrize("scales", ["tensor"])  # rows of both memories, and tensor scales
def test_a_recorded_step_replays_the_eager_steps_bits(fused, monkeypatch, scales):
    """The bug it fears: a recorded step (``thc.graphs``: a CUDA graph on a GPU; here its
    control flow run again on the same buffers) reading an input, a seed or the memory at the
    address the recording saw instead of this step's, or updating the memory in place where a
    kernel still reads it."""
    from gradsum.codecs.thc.graphs import StepGraph, run_recorded_step
    from gradsum.codecs.thc.step import KIND_GRADIENT, KIND_ROTATED

    monkeypatch.setattr(fused, "TILE", 128)
    monkeypatch.setattr(fused, "COLUMNS", 64)
    recorded, eager = codec_pair(True, scales, SMALL_SHAPES)
    graphs = [StepGraph(recorded, gradients(0, SMALL_SIZES)[w], worker=w, keys=[0, 1],
                        partition_elements=SMALL_PARTITION, capture=False)
              for w in range(2)]  # fmt: skip
    for step in range(3):  # eager, recorded, replayed
        inputs = gradients(step, SMALL_SIZES)
        got = run_recorded_step(graphs, inputs, step)
        want = run_step_round(eager, inputs, step=step, partition_elements=SMALL_PARTITION)
        for key, (average, expected) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(average, expected), (step, key)
    for state_key, memory in eager.memory.items():
        assert torch.equal(recorded.memory[state_key], memory), state_key
    layout = graphs[0].round.layout  # what the sizes are for: both memories, tensor scales,
    assert {KIND_ROTATED, KIND_GRADIENT} <= layout.kinds  # blocks across tiles, a ragged row
    assert layout.tensor_scales and layout.spans(0)
    assert [r.padded for r in layout.rows_of] == [256, 256, 64]


def test_gradients_the_batch_cannot_take_run_rounds_of_their_own(fused):
    """The bug it fears: a gradient with a partition shorter than a packed byte (a scalar
    parameter's) sending the whole step back to a round per gradient, or taken as a row that
    packs nothing; and a streaming reducer's waves, which the batch does not run, batched."""
    from gradsum.codecs.thc.step import StepRound

    generator = torch.Generator().manual_seed(9)
    sizes = [2 * PARTITION, 1, PARTITION + 1]  # the last one's last partition: 1 coordinate
    inputs = [[torch.randn(n, generator=generator) for n in sizes] for _ in range(2)]
    batched, reference = (make_codec("thc", workers=2, error_feedback=True) for _ in range(2))
    assert StepRound.batched_groups(batched, inputs[0], [0, 1, 2], PARTITION) == [0]
    got = run_step_round(batched, inputs, partition_elements=PARTITION)
    for key, average in enumerate(got):
        want = run_round(reference, [w[key] for w in inputs], key=key,
                         partition_elements=PARTITION).average  # fmt: skip
        assert torch.equal(average, want), key

    class Streaming(OneWorker):
        streams = True

    batched, reference = (make_codec("thc", workers=1, error_feedback=True) for _ in range(2))
    flats = [inputs[0][0], inputs[0][2]]
    got = CodecRound(batched, partition_elements=PARTITION).run_many(
        flats, Streaming(), worker=0, keys=[0, 1], step=0
    )
    rounds = CodecRound(reference, partition_elements=PARTITION)
    for key, flat in enumerate(flats):
        want = rounds.run(flat, Streaming(), worker=0, key=key, step=0)
        assert torch.equal(got[key], want), key


@pytest.fixture
def builds(monkeypatch):
    """How many gradients each batched round (``StepRound.build``) took, in order."""
    from gradsum.codecs.thc.step import StepRound

    built = []
    build = StepRound.build

    def counted(*args, **kwargs):
        built.append(len(args[1]))
        return build(*args, **kwargs)

    monkeypatch.setattr(StepRound, "build", staticmethod(counted))
    return built


def test_a_sessions_channel_runs_a_gradients_partitions_as_one_batch(fused, builds):
    """The bug it fears: training (every aggregator's ``Channel``, under the DDP hook and
    ``GradientSync`` alike) still running a round per partition, 77 launches each on a GPU,
    where the batched step takes them all in a fixed number; or the batch's average not the
    per-gradient round's."""
    from gradsum.sync.aggregator import Channel

    built = builds
    batched, reference = (make_codec("thc", workers=1, error_feedback=True) for _ in range(2))
    for codec in (batched, reference):
        codec.describe(2, SHAPES[2])
    flat = gradients(0)[0][2]  # three partitions, the last one short, four tensors
    channel = Channel([OneWorker()])
    for step in range(2):  # error feedback's memory carried from the first into the second
        got = channel.run(CodecRound(batched, seed=5, partition_elements=PARTITION), flat,
                          worker=0, key=2, step=step)  # fmt: skip
        want = CodecRound(reference, seed=5, partition_elements=PARTITION).run(
            flat, OneWorker(), worker=0, key=2, step=step
        )
        assert torch.equal(got, want), step
    assert built == [1, 1]  # one batch a round, not a round per partition


def test_a_release_of_every_group_is_one_batched_round(fused, builds, monkeypatch):
    """The bug it fears: local steps' outer round (``GradientSync.release`` without backward's
    hooks: every worker releases every group at once) still going group by group, a round
    each; or the batch writing one group's average into another's tensors."""
    from gradsum.sync import senders
    from gradsum.sync.gradient_sync import GradientSync
    from gradsum.sync.session import Session

    from ..sync.fakes import Alone, Reducing

    built = builds

    def released(batched: bool) -> list[torch.Tensor]:
        if not batched:  # the reference: a round per group (``submit`` alone)
            monkeypatch.delattr(senders.SerialSender, "submit_many")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 20))
        session = Session(make_codec("thc", workers=1, error_feedback=True), Reducing(Alone),
                          seed=5, partition_elements=PARTITION)  # fmt: skip
        sync = GradientSync(model, session, groups=[[3], [1, 2], [0]], on_backward=False,
                            broadcast_from=None)  # fmt: skip
        try:
            averages = []
            for step in range(2):  # error feedback's memory carried into the second round
                generator = torch.Generator().manual_seed(step)
                for p in sync.parameters:
                    p.grad = torch.randn(p.shape, generator=generator) * (1 + p.numel() % 7)
                sync.release()
                sync.wait()
                averages += [p.grad.clone() for p in sync.parameters]
            return averages
        finally:
            sync.close()

    got = released(batched=True)
    assert built == [3, 3]  # one batch of the three groups a round
    built.clear()
    want = released(batched=False)
    assert built == [1] * 6  # the reference: a round per group
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
