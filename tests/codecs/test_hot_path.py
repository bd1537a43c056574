"""THC's hot path on the CPU: the native kernels that replace torch operations give their bits.

What these pin: the sums of squares behind the norms (a summary on the wire, error feedback's
bound) are the kernels' one order to the last bit, whichever kernel measures them; the tensor
scales multiply as torch's elementwise operations do (the encode by one factor a piece);
error feedback's reconstruction made inside the encode is the decode of the payload alone,
bit for bit; and a round computes its tensor scales once per partition, not in every encode
and decode.
"""

import math

import pytest
import torch

from gradsum.codecs import make_codec, run_round
from gradsum.codecs.base import CodecContext
from gradsum.codecs.bits import unpack_bits
from gradsum.codecs.thc import codec as thc_codec
from gradsum.codecs.thc import native
from gradsum.codecs.thc.codec import THC

pytestmark = pytest.mark.skipif(not native.built(), reason="the C extension is not built")

# a matrix, vectors around it, one of 1 coordinate and one whose length is not a multiple of 8
PIECES = (3000, 17, 1, 40_000, 5, 1234)


@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    monkeypatch.setenv("GRADSUM_NATIVE", "1")


def _random(count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scales = torch.tensor([1e-3, 1.0, 30.0])[torch.randint(0, 3, (count,), generator=generator)]
    return torch.randn(count, generator=generator) * scales


def _kernel_squares(x: torch.Tensor) -> torch.Tensor:
    """The sum of squares of x in the kernels' order (``native.piece_squares``), written out:
    coordinate k to lane k % 64, float32 sums over spans of 4096 coordinates, the spans' lane
    sums in float64, the lanes folded pairwise (l + 32, + 16, ..., + 1), rounded to float32."""
    rows = torch.cat([x, x.new_zeros(-x.numel() % 64)]).view(-1, 64).square()
    lanes = torch.zeros(64, dtype=torch.float64)
    for start in range(0, rows.shape[0], 64):
        span = torch.zeros(64)
        for row in rows[start : start + 64]:  # one float32 addition after another per lane
            span = span + row
        lanes += span.double()
    for width in (32, 16, 8, 4, 2, 1):
        lanes[:width] = lanes[:width] + lanes[width : 2 * width]
    return lanes[0].float()


def test_piece_squares_are_the_kernels_order_bit_for_bit():
    """The summary's sums of squares are the kernels' order, not torch's (``segment_reduce``
    adds one square after another, a dependent chain four times slower than the pass over
    memory): each worker's summary is its own, and the MAX round hands every worker the same
    values, so workers agree whichever order each measured in. Pinned here so that every
    kernel that measures on the way (``rotate``, ``accumulate``) gives the same bits."""
    x = _random(sum(PIECES), seed=1)
    lengths = torch.tensor(PIECES)
    got = native.piece_squares(x, PIECES, lengths)
    expected = torch.stack([_kernel_squares(piece) for piece in x.split(PIECES)])
    assert torch.equal(got, expected)
    exact = torch.stack([piece.double().square().sum() for piece in x.split(PIECES)])
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=0)
    # torch's order differs in the last bits: the comparison above can tell
    assert not torch.equal(got, torch.segment_reduce(x.square(), "sum", lengths=lengths))


@pytest.mark.parametrize("described", [True, False], ids=["pieces", "one-piece"])
def test_accumulate_adds_and_measures_in_one_pass(described):
    """Error feedback's x + e outside the rotated domain (tensor scales, padding) comes with
    the sums of squares of x, e and every piece of x + e from the same pass. The bugs feared:
    a piece summed past its end or from a span misaligned with ``piece_squares``' (pieces cut
    through the kernel's spans of 4096), or a sum that is not torch's rounding."""
    pieces = (5000, 17, 1, 9000, 5, 1234) if described else (16_257,)
    n = sum(pieces)
    x, e = _random(n, seed=40), _random(n, seed=41) * 1e-2
    ends = torch.cumsum(torch.tensor(pieces), 0) if described else None
    total, sums, x_squares, e_squares = native.accumulate(x, e, ends)
    assert torch.equal(total, x + e)
    assert torch.equal(sums, native.piece_squares(x + e, pieces, torch.tensor(pieces)))
    assert x_squares == float(_kernel_squares(x)) and e_squares == float(_kernel_squares(e))


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
@pytest.mark.parametrize("add", [True, False], ids=["memory", "no-memory"])
def test_rotate_measures_its_leaves_as_piece_squares_does(add, wide):
    """The rotation of error feedback's input measures |R x|, |e| and |R x + e| from its
    finished leaves: the sums ``piece_squares`` gives of those vectors, at either width, and
    the rotation itself unchanged."""
    from gradsum.codecs.thc import _kernels

    was = _kernels.wide()
    _kernels.wide(wide)
    try:
        codec = THC(workers=2)
        n = 1 << 18
        x = _random(n, seed=50)
        e = _random(n, seed=51) * 1e-2 if add else None
        rotation = codec._rotation(n, CodecContext(), x.device)
        plain = native.rotate(x, rotation).clone()
        out, rotated, added, total = native.rotate(x, rotation, e, measure=True)
        assert torch.equal(out, plain + e if add else plain)
        one = (n,), torch.tensor([n])
        assert rotated == float(native.piece_squares(plain, *one))
        assert added == (float(native.piece_squares(e, *one)) if add else 0.0)
        assert total == float(native.piece_squares(out, *one))
    finally:
        _kernels.wide(was)


@pytest.mark.parametrize("described", [True, False], ids=["tensor-scales", "rotated-domain"])
def test_a_measured_input_has_the_summary_summarize_computes(described):
    """Error feedback's input made by a measuring kernel hands ``summarize`` the summary the
    kernel measured instead of another pass over it: the same bits as summarizing it afresh."""
    codec = make_codec("thc", workers=3, error_feedback=True)
    n = 1 << 16
    if described:
        codec.describe("k", [(n - 300,), (300,)])
        codec.partitions("k", n, 1 << 20)
    for step in range(2):  # the first without memory, the second with it
        ctx = CodecContext(seed=5, worker=1, step=step, partition=0, key=("k", 0))
        x = _random(n, seed=60 + step)
        w = codec.precondition(x, ctx)
        # measured by the kernel that made it (outside the rotated domain, the first step's
        # input is a copy of x: no kernel made it)
        assert (w in codec.inner._measured) == (step > 0 or not described)
        summary = codec.summarize(w, ctx)
        assert w not in codec.inner._measured
        assert torch.equal(summary, codec.summarize(w, ctx))  # afresh: nothing kept now
        shared = torch.stack([summary] * 3).amax(dim=0)
        codec.encode(w, ctx, shared)


@pytest.mark.parametrize("divide", [True, False], ids=["divide", "multiply"])
def test_scale_pieces_rounds_as_an_elementwise_operation(divide):
    x = _random(sum(PIECES), seed=2)
    lengths = torch.tensor(PIECES)
    factors = torch.rand(len(PIECES), generator=torch.Generator().manual_seed(3)) + 0.1
    repeated = torch.repeat_interleave(factors, lengths)
    expected = x / repeated if divide else x * repeated
    out = torch.empty_like(x)
    assert native.scale_pieces(x, PIECES, lengths, factors, divide, out)
    assert torch.equal(out, expected)
    assert native.scale_pieces(x, PIECES, lengths, factors, divide, x)  # in place
    assert torch.equal(x, expected)


def _shared(codec, xs, ctxs):
    summaries = [codec.summarize(x, ctx) for x, ctx in zip(xs, ctxs, strict=True)]
    return torch.stack(summaries).amax(dim=0)


@pytest.mark.parametrize(
    ("options", "length", "described"),
    [({}, 1 << 16, True), ({}, 50_000, False), ({"correlated": True}, 1 << 16, True),
     ({"bits": 8}, 50_000, True)],
    ids=["tensor-scales", "padded", "correlated", "8-bits"],
)  # fmt: skip
def test_the_reconstruction_inside_the_encode_is_the_decode_of_the_payload(
    options, length, described, monkeypatch
):
    """The bug feared: the own values dequantized with other scalars than the decode's (a
    contributor count, the sqrt of the block, the tensor scales), or transformed back another
    way; error feedback's memory would then drift from what the other workers decode."""
    inverse_residual = native.inverse_residual
    codec = make_codec("thc", workers=3, error_feedback=False, **options)
    pieces = (length - 300, 300) if described else None
    if described:
        codec.describe("k", [(length - 300,), (300,)])
        codec.partitions("k", length, 1 << 20)
    ctxs = [CodecContext(seed=5, worker=w, step=2, partition=0, key=("k", 0)) for w in range(3)]
    xs = [_random(length, seed=10 + w) for w in range(3)]
    if pieces is not None:
        xs[1][-300:] *= 1e-3  # tensors of their own scales
    shared = _shared(codec, xs, ctxs)
    expected_payload = codec.encode(xs[1], ctxs[1], shared)
    expected_own = codec.reconstruct(expected_payload, ctxs[1], shared).clone()

    def refuse(*args, **kwargs):
        raise AssertionError("the reconstruction summed and decoded the payload again")

    monkeypatch.setattr(native, "lookup_sum", refuse)
    payload, own = codec.encode_and_reconstruct(xs[1], ctxs[1], shared)
    assert torch.equal(payload.fields["indices"], expected_payload.fields["indices"])
    assert torch.equal(own, expected_own)
    # error feedback's memory, the reconstruction scaled and subtracted by the last pass of the
    # transform back, never written out: the values of torch's subtraction (a fused
    # multiply-add, or the padding kept, would differ)
    calls = []
    monkeypatch.setattr(native, "inverse_residual",
                        lambda *a, **k: calls.append(1) or inverse_residual(*a, **k))  # fmt: skip
    payload, error = codec.encode_and_residual(xs[1], ctxs[1], shared)
    assert calls and error.shape == (length,)
    assert torch.equal(payload.fields["indices"], expected_payload.fields["indices"])
    assert torch.equal(error, xs[1] - expected_own)


def test_error_feedback_on_the_native_path_keeps_the_reference_memory():
    """The same memory and averages, step after step, as the generic reconstruction (encode,
    then sum and decode the payload alone) gives on the same native encode."""

    def rounds(fused: bool):
        codec = make_codec("thc", workers=2, error_feedback=True)
        codec.describe("k", [(70_000,), (1000,)])
        if not fused:  # the generic path: encode, decode the payload alone, subtract
            inner = codec.inner
            inner.encode_and_residual = lambda x, ctx, shared=None: (
                (p := inner.encode(x, ctx, shared)),
                x.reshape(-1) - inner.reconstruct(p, ctx, shared),
            )
        averages = []
        for step in range(3):
            xs = [_random(71_000, seed=100 * step + w) for w in range(2)]
            averages.append(run_round(codec, xs, key="k", step=step).average.clone())
        return averages, {k: v.clone() for k, v in codec.memory.items()}

    fused, generic = rounds(True), rounds(False)
    assert all(torch.equal(a, b) for a, b in zip(fused[0], generic[0], strict=True))
    assert fused[1].keys() == generic[1].keys()
    assert all(torch.equal(fused[1][k], generic[1][k]) for k in fused[1])


def test_a_round_computes_each_partitions_tensor_scales_once(monkeypatch):
    """Encode, error feedback's reconstruction and decode all use one partition's scales: the
    bug feared is their recomputation (a reduction and a dozen small operations, per use)."""
    calls = []
    original = thc_codec.THC._tensor_scales

    def counted(self, shared, pieces, device):
        calls.append(pieces)
        return original(self, shared, pieces, device)

    monkeypatch.setattr(thc_codec.THC, "_tensor_scales", counted)
    codec = make_codec("thc", workers=4, error_feedback=True)
    codec.describe("k", [(20_000,), (30_000,), (10_000,), (5,)])
    xs = [_random(60_005, seed=w) for w in range(4)]
    run_round(codec, xs, key="k", step=0, partition_elements=1 << 15)
    assert len(calls) == 2  # two partitions, each computed once for 4 workers and the decode
    first = len(calls)
    run_round(codec, xs, key="k", step=1, partition_elements=1 << 15)
    assert len(calls) == 2 * first  # a new round's MAX result: computed again


@pytest.mark.parametrize("spread", [False, True], ids=["fixed-clamp", "spread-clamp"])
def test_tensor_scales_read_on_the_cpu_are_the_torch_paths(monkeypatch, spread):
    """Where the CPU's native kernels take the round's scalars, the tensor scales check the
    norms as Python floats instead of deferred device checks; every value (largest norm,
    clamp, factors, divisors) must stay the torch path's bit for bit, or workers on the two
    paths would round on different grids. The bugs feared: a square root or a sum taken in
    another order (Python's ``math.sqrt`` of the lengths differs from torch's in the last bit
    for some), or a piece of RMS 0 given a divisor other than 1; and invalid norms let through."""
    generator = torch.Generator().manual_seed(41)
    codec = make_codec("thc", workers=4, correlated=spread)
    for trial in range(40):
        # lengths whose square roots torch (its vectorised CPU kernel) and math.sqrt differ in
        # the last bit on the CPUs tried: 2, 8, 19, 32
        drawn = torch.randint(1, 100_000, (trial % 11,), generator=generator).tolist()
        pieces = (2, 8, 19, 32, *drawn)
        exponents = torch.randint(-20, 20, (4 * len(pieces),), generator=generator)
        shared = (torch.rand(4 * len(pieces), generator=generator) * 10.0**exponents).float()
        shared.view(4, -1)[:, 0] = 0  # a piece of RMS 0 on every worker
        shared[trial % shared.numel()] = 0
        monkeypatch.setenv("GRADSUM_NATIVE", "1")
        got = codec._tensor_scales(shared, pieces, shared.device)
        monkeypatch.setenv("GRADSUM_NATIVE", "0")
        want = codec._tensor_scales(shared, pieces, shared.device)
        assert float(got[0]) == float(want[0]) and float(got[1]) == float(want[1])
        assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
        assert float(got[3][0]) == 1.0
    monkeypatch.setenv("GRADSUM_NATIVE", "1")
    for bad in (float("nan"), float("inf"), -1.0):
        shared = torch.ones(8)
        shared[3] = bad
        with pytest.raises(ValueError, match="invalid norms"):
            codec._tensor_scales(shared, (10, 20), shared.device)


@pytest.mark.parametrize(
    "options",
    [{}, {"bits": 8}, {"bits": 2}, {"correlated": True}, {"rotation_block": 1024}],
    ids=["4-bits", "8-bits", "2-bits", "correlated", "blocks"],
)
def test_the_residual_inside_the_encode_is_w_minus_the_decode_of_its_payload(options):
    """Error feedback in the rotated domain keeps w - (what the payload alone decodes to), made
    by the encode from its own rounding. The bugs feared: a residual of another level than the
    index sent (off by one, or of the unclamped value), or the same value rounded another way
    (step as 1 / a, a fused multiply-add) than the decode's step*T + offset, which the torch
    path computes; the memory would then drift from what the other workers decode."""
    codec = make_codec("thc", workers=3, error_feedback=True, **options)
    inner = codec.inner
    length = 1 << 16
    ctx = CodecContext(seed=7, worker=1, step=3, partition=0, key=("k", 0))
    x = _random(length, seed=21)
    w = codec.precondition(x, ctx)
    shared = codec.summarize(w, ctx)
    payload, error = inner.encode_transformed(w, length, ctx, shared)
    indices = unpack_bits(payload.fields["indices"], inner.bits, length).long()
    assert int((indices == 0).sum()) and int((indices == (1 << inner.bits) - 1).sum())  # clamped
    step = inner._round_scalars(shared, None, w.device, length).step
    table = torch.tensor(inner.table, dtype=torch.float32)
    decoded = table[indices].mul_(step).add_(-step * inner.granularity / 2)
    assert torch.equal(error, w - decoded)


@pytest.mark.parametrize("block", [None, 1024, 8], ids=["whole", "blocks", "8"])
def test_the_encode_scales_each_piece_by_its_own_factor(block):
    """The native encode scales each piece by its tensor scale as the rotation reads it,
    instead of a divided copy first: x times a / divisor, that factor rounded to float32 once
    (a multiplication, not the division ``scale_pieces`` makes: a vector divide cost more
    than the rest of the rotation's first pass). The same payload and own reconstruction, bit
    for bit, as the encode of x multiplied by those factors first, for pieces that straddle
    vectors (lengths 17, 1, 5), a padded rotation and blocks of one vector. The bug feared: a
    coordinate scaled by its neighbouring piece's factor."""
    codec = THC(workers=2, rotation_block=block)
    x = _random(sum(PIECES), seed=30)
    lengths = torch.tensor(PIECES)
    divisors = torch.rand(len(PIECES), generator=torch.Generator().manual_seed(31)) * 10 + 0.01
    ends = torch.cumsum(lengths, 0)
    rotation = codec._rotation(x.numel(), CodecContext(), x.device)
    a, g = 0.37, codec.granularity
    root = math.sqrt(rotation.block)
    # the kernel's scale (a over the unnormalised transform's sqrt(block), as float32), over
    # each piece's divisor in float64, rounded once
    scale = torch.tensor(a / root, dtype=torch.float32).double()
    factors = (scale / divisors.double()).float()
    scaled = torch.empty_like(x)
    assert native.scale_pieces(x, PIECES, lengths, factors, False, scaled)
    rest = (g / 2, g, codec._tables(x.device).cell_entries, 99, codec.bits)
    own = (0.25, -3.0)
    expected = native.encode(scaled, rotation, root, *rest, own=own)  # a scale of 1
    expected_own = rotation.scratch.clone()
    fused = native.encode(x, rotation, a, *rest, own=own, pieces=(ends, divisors))
    assert torch.equal(fused, expected)
    assert torch.equal(rotation.scratch, expected_own)
    # the division's values differ in the last bits: the comparison above can tell
    assert not torch.equal(scaled, (x / torch.repeat_interleave(divisors, lengths)) * a / root)
