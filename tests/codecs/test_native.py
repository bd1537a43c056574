"""The native CPU kernels against the torch path they replace.

Every test forces the native path on (GRADSUM_NATIVE=1), even when the suite runs with it off,
and switches to torch explicitly where it compares the two.
"""

import math

import pytest
import torch

from gradsum.codecs import make_codec, nmse, run_round
from gradsum.codecs.base import CodecContext, NonFiniteGradientError, Payload
from gradsum.codecs.bits import pack_bits, unpack_bits
from gradsum.codecs.thc import native
from gradsum.codecs.thc.codec import THC, GridCodec, UniformTHC
from gradsum.codecs.thc.hadamard import Rotation, fwht_

from .conftest import gaussian_inputs

pytestmark = [
    pytest.mark.skipif(
        not native.built(),
        reason="the C extension gradsum.codecs.thc._kernels is not built (no C compiler at "
        "install time); the torch path it replaces is covered by the other codec tests",
    ),
    pytest.mark.pins_native,  # every test sets its own path (below)
]

ANALYTIC_THC_NMSE = 0.0203


@pytest.fixture(autouse=True)
def native_on(monkeypatch):
    monkeypatch.setenv("GRADSUM_NATIVE", "1")


@pytest.fixture
def native_only(monkeypatch):
    """Fail loudly if the codec falls back to torch's stochastic rounding."""

    def torch_path(*args):
        raise AssertionError("took the torch path")

    monkeypatch.setattr(GridCodec, "_round_to_table", torch_path)


def _random(count, seed, high=None, dtype=torch.float32):
    """Gaussian floats, or integers in [0, high)."""
    generator = torch.Generator().manual_seed(seed)
    if high is None:
        return torch.randn(count, generator=generator, dtype=dtype)
    return torch.randint(0, high, (count,), generator=generator, dtype=dtype)


# -- FWHT ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("length", "block"),
    [(8, 8), (3 * 64, 64), (4096, 4096), (5 * 1024, 1024), (1 << 16, 1 << 16), (1 << 18, 1 << 18)],
)
def test_fwht_matches_torch(both, length, block):
    x = _random(length, seed=length + block)
    fast, slow = both(lambda: fwht_(x.clone(), block).clone())
    assert torch.allclose(fast, slow, atol=1e-5)


def test_fwht_falls_back_where_the_kernel_cannot_run():
    x = torch.randn(64)
    assert not native.fwht_(x.clone(), 4, 0.5)  # block shorter than a vector
    assert not native.fwht_(x.double(), 64, 0.125)
    assert not native.fwht_(torch.randn(64, 2)[:, 0], 64, 0.125)  # not contiguous


@pytest.mark.parametrize(("length", "block"), [(1000, None), (1 << 17, None), (3000, 1024)])
def test_rotation_roundtrip(both, length, block):
    x = _random(length, seed=length)

    def roundtrip():
        rotation = Rotation(length, block, seed=7, device="cpu")
        y = rotation.forward(x)
        return y.clone(), rotation.inverse(y).clone()

    (y_fast, back_fast), (y_slow, _) = both(roundtrip)
    assert torch.allclose(y_fast, y_slow, atol=1e-5)
    assert torch.allclose(back_fast, x, atol=1e-5)


# -- aggregator and packing -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("codec", "workers"),
    [
        (THC(workers=1), 1),
        (THC(workers=4), 4),
        (THC(workers=8), 8),  # 8 * 30 = 240: the last byte-wide sum
        (THC(workers=9), 9),  # 9 bits: 16-bit accumulators
        (THC(workers=32), 32),
        (THC(workers=3, bits=1, granularity=7), 3),
        (THC(workers=5, bits=2, granularity=12), 5),
        (THC(workers=4, bits=8, granularity=255), 4),
        (THC(workers=2, bits=4, granularity=300), 2),  # table beyond a byte: no vpshufb
        (UniformTHC(workers=6, bits=4), 6),
    ],
    ids=str,
)
@pytest.mark.parametrize("length", [1, 77, 4096 + 40, 3 * 4096 + 64])
def test_aggregate_is_bit_identical(both, codec, workers, length):
    count = codec._coordinates(length)
    upstream = [
        pack_bits(_random(count, seed=w, high=1 << codec.bits, dtype=torch.int64), codec.bits)
        for w in range(workers)
    ]
    payloads = [Payload({"indices": p}, length) for p in upstream]
    ctx = CodecContext(worker=-1)
    fast, slow = both(lambda: codec.aggregate(payloads, ctx).fields["sums"])
    assert torch.equal(fast, slow)


@pytest.mark.parametrize(("bits", "width"), [(1, 1), (1, 3), (2, 5), (4, 4), (4, 7), (8, 8)])
@pytest.mark.parametrize("count", [1, 8, 33, 4096 + 8 * 3 + 5])
def test_packing_matches_bits_module(bits, width, count):
    """A single payload through an identity table is packed exactly like pack_bits."""
    values = _random(count, seed=count, high=1 << bits, dtype=torch.int64)
    identity = torch.arange(1 << bits, dtype=torch.int32)
    packed = native.lookup_sum([pack_bits(values, bits)], bits, identity, count, width)
    assert torch.equal(packed, pack_bits(values, width))


@pytest.mark.parametrize("width", range(1, 17))
@pytest.mark.parametrize("count", [1, 8, 31, 4096 + 57])
def test_unpacking_matches_bits_module(width, count):
    values = _random(count, seed=width * count, high=1 << width, dtype=torch.int64)
    decoded = native.decode(pack_bits(values, width), width, count, 1.0, 0.0, rotation=None)
    assert torch.equal(decoded, unpack_bits(pack_bits(values, width), width, count).float())


# Rotations whose blocks end inside a leaf, a chunk, or span several chunks (the kernels group a
# transform's stages by cache level: leaves of 4096, chunks of 2**17 coordinates), with padding.
ROTATIONS = [(5000, None), (3 * 4096 + 5, 1024), (40_000, 16_384), ((1 << 18) + 77, None)]


@pytest.mark.parametrize(("length", "block"), ROTATIONS)
def test_decode_matches_torch(both, length, block):
    codec = THC(workers=4, rotation_block=block)
    inputs = gaussian_inputs(4, length, seed=3)
    result = run_round(codec, inputs)
    ctx = CodecContext()
    fast, slow = both(lambda: codec.decode(result.aggregate, ctx, result.shared))
    assert fast.shape == slow.shape == (length,)
    # the kernels run the stages in another order than torch: float32 rounding, ~1e-7 in norm
    assert float((fast - slow).norm() / slow.norm()) < 1e-6


@pytest.mark.parametrize(("length", "block"), ROTATIONS)
def test_encode_quantizes_the_rotated_input(monkeypatch, length, block):
    """The fused encode (scale and signs applied as the transform loads the gradient) rounds the
    same values as rotating with torch first: with one seed both draw the same uniforms, so only
    float32 rounding of the transform can flip an index."""
    codec = THC(workers=1, rotation_block=block)
    x = _random(length, seed=length)
    rotation = Rotation(length, block, seed=7, device="cpu")
    cells, g, a, c = codec._tables(x.device).cell_entries, codec.granularity, 3.0, 15.0
    fused = native.encode(x, rotation, a, c, g, cells, 11, codec.bits)
    monkeypatch.setenv("GRADSUM_NATIVE", "0")
    rotated = rotation.forward(x).clone()
    monkeypatch.setenv("GRADSUM_NATIVE", "1")
    separate = native.encode(rotated, None, a, c, g, cells, 11, codec.bits)
    count = rotation.padded
    same = unpack_bits(fused, codec.bits, count) == unpack_bits(separate, codec.bits, count)
    assert float(same.double().mean()) > 0.999


# -- worker encode ---------------------------------------------------------------------------------
def _encode_indices(codec, u, seed):
    """Table indices of grid positions u (in [0, g]) through native.encode."""
    cells = codec._tables(u.device).cell_entries
    packed = native.encode(u, None, 1.0, 0.0, codec.granularity, cells, seed, codec.bits)
    return unpack_bits(packed, codec.bits, u.numel()).long()


def test_rounding_is_unbiased_with_error_shrinking_like_one_over_trials():
    codec = THC(workers=1)
    table = torch.tensor(codec.table, dtype=torch.float64)
    u = torch.rand(1 << 14, generator=torch.Generator().manual_seed(0)) * codec.granularity
    u[:3] = torch.tensor([0.0, float(codec.granularity), 14.0])  # ends and a table value
    total, errors = torch.zeros_like(u, dtype=torch.float64), {}
    for trial in range(1, 257):
        total += table[_encode_indices(codec, u, seed=trial)]
        if trial in (64, 256):
            errors[trial] = float((total / trial - u.double()).pow(2).mean())
    # unbiased: the squared error of the mean is all variance, a quarter of it at 4x the trials
    assert errors[256] / errors[64] == pytest.approx(0.25, rel=0.15)


def test_rounding_has_the_same_distribution_as_the_torch_path():
    """Both paths pick one of the two neighbouring table values, the upper one with probability
    (u - low) / (high - low): a two-point distribution, checked by a chi-square statistic."""
    codec, trials = THC(workers=1), 400
    u = torch.linspace(0, codec.granularity, 997)
    table = torch.tensor(codec.table, dtype=torch.float64)
    below = torch.searchsorted(table, u.double(), right=True).clamp(max=15) - 1
    p_up = (u.double() - table[below]) / (table[below + 1] - table[below])
    native_indices = torch.stack([_encode_indices(codec, u, seed) for seed in range(trials)])
    torch_indices = torch.stack(
        [codec._round_to_table(u.clone(), CodecContext(step=s)).long() for s in range(trials)]
    )
    for indices in (native_indices, torch_indices):
        up = indices - below
        assert bool(((up == 0) | (up == 1)).all())
        ups, expected = up.sum(0).double(), trials * p_up
        certain = (p_up == 0) | (p_up == 1)
        assert torch.equal(ups[certain], expected[certain])
        chi2 = (ups - expected)[~certain].pow(2) / (expected * (1 - p_up))[~certain]
        assert float(chi2.mean()) < 1.3  # 1 on average; 1.3 is about 6 standard deviations


@pytest.mark.parametrize("workers", [1, 4])
def test_thc_nmse_through_the_native_path(native_only, workers):
    inputs = gaussian_inputs(workers, 1 << 18, seed=workers)
    codec = make_codec("thc", workers=workers, error_feedback=False)
    measured = nmse(run_round(codec, inputs).average, inputs)
    assert measured == pytest.approx(ANALYTIC_THC_NMSE / workers, rel=0.10)


@pytest.mark.parametrize(
    ("name", "length"),
    # a rotation shorter than 8 coordinates stays with torch; the unrotated uniform THC has none
    [("thc", 13), ("thc", 1000), ("thc", 4096 + 3), ("thc-uniform", 13), ("thc-uniform", 4099),
     ("thc-uniform-unrotated", 1), ("thc-uniform-unrotated", 4099)],
)
def test_odd_lengths_round_trip(native_only, name, length):
    codec = make_codec(name, workers=2, error_feedback=False)
    inputs = gaussian_inputs(2, length, seed=length)
    result = run_round(codec, inputs)
    assert result.average.shape == (length,)
    assert nmse(result.average, inputs) < (0.02 if name == "thc" else 0.2)


def test_encode_is_deterministic_in_the_seed(native_only):
    codec = THC(workers=2)
    x = _random(1 << 12, seed=1)
    shared = codec.summarize(x, CodecContext())

    def encode(worker, step):
        ctx = CodecContext(seed=5, worker=worker, step=step)
        return codec.encode(x, ctx, shared).fields["indices"]

    assert torch.equal(encode(0, 0), encode(0, 0))
    assert not torch.equal(encode(0, 0), encode(1, 0))  # independent per worker
    assert not torch.equal(encode(0, 0), encode(0, 1))  # and per step


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("GRADSUM_NATIVE", "0")
    assert not native.available()
    assert not native.fwht_(torch.randn(64), 64, 0.125)


def test_bits_of_the_rotation_signs_match_the_float_signs():
    rotation = Rotation(100, None, seed=3, device="cpu")
    negative = unpack_bits(rotation.sign_bits, 1, rotation.padded).bool()
    assert torch.equal(negative, rotation.signs < 0)
    assert math.isclose(float(rotation.signs.abs().sum()), rotation.padded)


@pytest.mark.parametrize("name", ["thc", "thc-uniform"])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_non_finite_input_raises_through_the_native_path(native_only, name, bad):
    codec = make_codec(name, workers=1, error_feedback=False)
    x = torch.randn(1000)
    ctx = CodecContext()
    shared = codec.summarize(x, ctx)
    x[123] = bad
    with pytest.raises(NonFiniteGradientError, match=r"\[123\]"):
        codec.encode(x, ctx, shared)


def test_norm_near_the_float32_limit_does_not_overflow_the_transform(native_only):
    """Unnormalised, the rotated coordinates would be about the norm itself (2e38) times N(0, 1),
    many beyond float32's 3.4e38; the kernel scales before it transforms."""
    inputs = [t * (2e38 / 256) for t in gaussian_inputs(1, 1 << 16, seed=4)]
    norm = float(torch.linalg.vector_norm(inputs[0], dtype=torch.float64))
    assert 1e38 < norm < torch.finfo(torch.float32).max
    average = run_round(make_codec("thc", workers=1, error_feedback=False), inputs).average
    assert bool(torch.isfinite(average).all())
    assert nmse(average, inputs) == pytest.approx(ANALYTIC_THC_NMSE, rel=0.15)


# -- the sixteen-wide (AVX-512) kernels ------------------------------------------------------------
@pytest.fixture(params=[False, True], ids=["narrow", "wide"])
def width(request):
    """Each test once with the eight-wide kernels and once with the sixteen-wide ones (where
    the CPU has AVX-512; the same eight-wide run otherwise)."""
    kernels = native._kernels
    was = kernels.wide()
    kernels.wide(request.param)
    yield request.param
    kernels.wide(was)


def _both_ways(switch, make):
    """make() with a kernel switch (``wide``, ``v3``) off and then on."""
    was = switch()
    try:
        switch(False)
        off = make()
        switch(True)
        on = make()
    finally:
        switch(was)
    return off, on


# blocks of 8 (the eight-wide kernels' alone), 16, one leaf, several chunks; padded lengths; a
# default partition of 2**20, whose block does not fit L2 (the transform parks it in memory)
WIDTH_ROTATIONS = [(1000, 8), (4096 + 40, 16), (5000, None), (40_000, 16_384),
                   ((1 << 18) + 77, None), (3 << 17, None), (1 << 20, None)]  # fmt: skip


def _kernel_outputs(length, block, options):
    """Every native kernel's output on one input: rotations (plain, added to), encodes (with
    strata, with own reconstruction and tensor scales, unrotated with error feedback's error),
    inverses and residuals, decodes of narrow and wide sums (plain, scaled, unrotated)."""
    correlated = options.get("correlated", False)
    codec = THC(workers=3, rotation_block=block, **options)
    x = _random(length, seed=length)
    cells, g = codec._tables(x.device).cell_entries, codec.granularity
    strata = (1234, 3, 1) if correlated else None
    pieces = (length // 3, 17, length - length // 3 - 17)
    ends = torch.cumsum(torch.tensor(pieces), 0)
    factors = torch.tensor([0.5, 3.0, 1.7])
    rotation = Rotation(length, block, seed=7, device="cpu")
    n = rotation.padded
    sums = _random(n, seed=3, high=1 << 7, dtype=torch.int64)
    wide_sums = _random(n, seed=4, high=1 << 12, dtype=torch.int64)
    args = (3.0, g / 2, g, cells, 11, codec.bits)
    results = [
        native.rotate(x, rotation).clone(),
        native.rotate(x, rotation, add=x.new_ones(n)).clone(),
    ]
    results.append(native.encode(x, rotation, *args, strata=strata))
    results.append(native.encode(x, rotation, *args, own=(0.25, -3.0), pieces=(ends, factors)))
    results.append(rotation.scratch.clone())
    results.append(native.inverse(rotation).clone())
    native.encode(x, rotation, *args, own=(0.25, -3.0))
    results.append(native.inverse_residual(rotation, x, (ends, factors)))
    native.encode(x, rotation, *args, own=(0.25, -3.0))
    results.append(native.inverse_residual(rotation, x, None))
    error = torch.empty(length)
    results.append(native.encode(x, None, *args, error=(error, 0.1, -1.5), strata=strata))
    results.append(error)
    for values, width in ((sums, 7), (wide_sums, 12)):
        packed = pack_bits(values, width)
        results.append(native.decode(packed, width, n, 0.1, -3.0, rotation).clone())
        results.append(native.decode(packed, width, n, 0.1, -3.0, rotation,
                                     pieces=(ends, factors))[:length].clone())  # fmt: skip
        results.append(native.decode(packed, width, n, 0.1, -3.0, None).clone())
    return results


def _assert_same_outputs(first, second):
    assert all(r is not None for r in first)
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        assert torch.equal(a, b), f"output {i}: {int((a != b).sum())} of {a.numel()} differ"


@pytest.mark.parametrize(("length", "block"), WIDTH_ROTATIONS)
@pytest.mark.parametrize(
    "options",
    [{}, {"correlated": True}, {"bits": 8}, {"bits": 2, "granularity": 12},
     {"bits": 1, "granularity": 7}, {"granularity": 300}],
    ids=["4-bits", "correlated", "8-bits", "2-bits", "1-bit", "wide-grid"],
)  # fmt: skip
def test_the_wide_kernels_give_the_narrow_kernels_bits(length, block, options):
    """The AVX-512 kernels run the transform's stages in the same order and draw the same
    uniforms: every output is bit for bit the eight-wide kernels', so workers on either CPU
    decode the same averages. The bug feared: a lane, a sign bit or a draw out of place."""
    narrow, wide = _both_ways(native._kernels.wide,
                              lambda: _kernel_outputs(length, block, options))  # fmt: skip
    _assert_same_outputs(narrow, wide)


@pytest.mark.parametrize(("length", "block"), [*WIDTH_ROTATIONS, (40, None), (4096 + 8, None)])
@pytest.mark.parametrize("options", [{}, {"granularity": 31}], ids=["4-bits", "31-cells"])
def test_the_avx2_paths_give_the_generic_paths_bits(length, block, options):
    """The x86-64-v3 paths (the 4-bit rounding: the generator's two halves in program order,
    the grid's cells chosen by blends, the indices packed in registers; the dequantization of
    sums read straight from their packed bytes) give the generic eight-wide loops' outputs bit
    for bit, leaf tails and short inputs included. The bugs feared: a nibble out of place, a
    half drawn out of turn, a cell of the grid's upper parts chosen wrong, a sum's bits taken
    from the wrong byte or shift."""
    if not native._kernels.v3():
        pytest.skip("the x86-64-v3 paths need AVX2")
    was = native._kernels.wide()
    native._kernels.wide(False)  # the eight-wide path is where the x86-64-v3 paths run
    try:
        generic, v3 = _both_ways(native._kernels.v3,
                                 lambda: _kernel_outputs(length, block, options))  # fmt: skip
    finally:
        native._kernels.wide(was)
    _assert_same_outputs(generic, v3)


@pytest.mark.parametrize(
    "pieces",
    [(1001, 17, 2982), (7, 1, 3992), (4000,), (3, 5, 3992),
     (300_001, 7, 1, 748_000)],  # a default partition's rotation of 2**20, pieces mid-vector
    ids=["mid-vector", "short", "one", "tiny", "at-scale"],
)  # fmt: skip
@pytest.mark.parametrize("block", [None, 1024])
def test_the_tensor_scales_factors_reach_every_coordinate_of_their_piece(pieces, block):
    """The encode multiplies each piece by its factor a / divisor as its first pass reads x
    (no scaled copy): the payload is the one of x scaled beforehand, coordinate by coordinate,
    and encoded with the factor 1. Pieces end mid-vector and are shorter than a vector, where
    a factor found once for eight coordinates would give a neighbour's piece the wrong one.
    (Blocks of 4096, 2**20 or 1024 coordinates: sqrt(block) is a power of two, 1 is exact.)"""
    codec = THC(workers=2, rotation_block=block)
    length = sum(pieces)
    x = _random(length, seed=61)
    rotation = Rotation(length, block, seed=5, device="cpu")
    root = math.sqrt(rotation.block)
    cells, g = codec._tables(x.device).cell_entries, codec.granularity
    ends = torch.cumsum(torch.tensor(pieces), 0)
    divisors = torch.tensor([0.7, 3.0, 1.9, 0.05, 0.3][: len(pieces)])
    a = 3.0
    # the kernel's factors: float32 of a / sqrt(block), over each divisor in float64
    scale = float(torch.tensor(a / root, dtype=torch.float32))
    factors = (scale / divisors.double()).float()
    scaled = x * torch.repeat_interleave(factors, torch.tensor(pieces))
    by_pieces = native.encode(x, rotation, a, g / 2, g, cells, 11, 4, pieces=(ends, divisors))
    by_hand = native.encode(scaled, rotation, root, g / 2, g, cells, 11, 4)
    assert by_pieces is not None and by_hand is not None
    assert torch.equal(by_pieces, by_hand)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [8, 4096, 4096 * 3 + 40, 77])
def test_the_avx2_dequantization_reads_every_sum_width(bits, count):
    """Sums of 1 to 8 bits (4 workers' 4-bit indices sum to 7; 8 workers' to 8), decoded
    unrotated by the x86-64-v3 path against the generic unpacking, on lengths that end
    mid-group and mid-leaf: the same values, and the sums themselves recovered."""
    if not native._kernels.v3():
        pytest.skip("the x86-64-v3 paths need AVX2")
    sums = _random(count, seed=bits, high=1 << bits, dtype=torch.int64)
    packed = pack_bits(sums, bits)

    def decode():
        return native.decode(packed, bits, count, 1.0, 0.0, None).clone()

    generic, v3 = _both_ways(native._kernels.v3, decode)
    assert torch.equal(generic, v3)
    assert torch.equal(v3, sums.to(torch.float32))


@pytest.mark.parametrize(("length", "block"), [(5000, None), ((1 << 18) + 77, None), (3000, 1024)])
def test_the_residual_in_the_transform_back_is_inverse_then_residual(width, length, block):
    """``inverse_residual`` (the residual stored by the transform's last pass) gives what the
    reconstruction written out and ``residual`` give, bit for bit, padding dropped."""
    codec = THC(workers=2, rotation_block=block)
    x = _random(length, seed=5)
    pieces = (length - 300, 1, 299)
    lengths = torch.tensor(pieces)
    factors = torch.tensor([0.3, 7.0, 2.5])
    rotation = Rotation(length, block, seed=9, device="cpu")
    cells, g = codec._tables(x.device).cell_entries, codec.granularity
    args = (x, rotation, 2.0, g / 2, g, cells, 13, codec.bits)
    for scaled in (None, (torch.cumsum(lengths, 0), factors)):
        native.encode(*args, own=(0.5, -7.0))
        own = native.inverse(rotation).clone()
        expected = native.residual(x, own, None if scaled is None else pieces,
                                   None if scaled is None else lengths, factors)  # fmt: skip
        native.encode(*args, own=(0.5, -7.0))
        assert torch.equal(native.inverse_residual(rotation, x, scaled), expected)


@pytest.mark.parametrize(("length", "block"), [(5000, None), (40_000, 16_384), (77, None)])
def test_the_decode_scales_the_pieces_as_scale_pieces_does(width, length, block):
    """The decode's multiplication by the tensor scales as it stores the values (THC.decode's
    native path) rounds as ``scale_pieces`` after the decode does."""
    rotation = Rotation(length, block, seed=9, device="cpu")
    n = rotation.padded
    packed = pack_bits(_random(n, seed=8, high=1 << 6, dtype=torch.int64), 6)
    pieces = (length - 40, 3, 37)
    lengths = torch.tensor(pieces)
    factors = torch.tensor([0.3, 7.0, 2.5])
    plain = native.decode(packed, 6, n, 0.1, -3.0, rotation)[:length].clone()
    expected = torch.empty(length)
    assert native.scale_pieces(plain, pieces, lengths, factors, False, expected)
    scaled = native.decode(packed, 6, n, 0.1, -3.0, rotation,
                           pieces=(torch.cumsum(lengths, 0), factors))  # fmt: skip
    assert torch.equal(scaled[:length], expected)


@pytest.mark.parametrize("where", [0, 4100, 8200, 8204], ids=["first", "leaf", "last-16", "tail"])
@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_the_unrotated_encode_refuses_non_finite_values_in_either_width(width, where, bad):
    """The wide rounding checks the values it reads (no pass of its own), the eight-wide one
    first reads each leaf for them: either way an Inf or NaN anywhere, in a leaf's sixteen-wide
    part or its tail, makes the encode raise, naming the coordinate."""
    codec = THC(workers=1)
    x = _random(8205, seed=6)
    cells, g = codec._tables(x.device).cell_entries, codec.granularity
    args = (None, 1.0, g / 2, g, cells, 3, codec.bits)
    error = torch.empty_like(x)
    assert native.encode(x, *args, error=(error, 0.1, -1.5)) is not None
    x[where] = bad
    with pytest.raises(NonFiniteGradientError, match=rf"\[{where}\]"):
        native.encode(x, *args, error=(error, 0.1, -1.5))
    with pytest.raises(NonFiniteGradientError, match=rf"\[{where}\]"):
        native.encode(x, *args)


@pytest.mark.parametrize(
    "shapes",
    [[(700,), (30, 41), (1,), (1069,)],  # 3,000 coordinates, padded to 4,096
     [(1000, 1000), (48_576,), (1003,)]],  # 2**20 + 1,003: a default partition's size, padded
    ids=["small", "2^20+1003"],
)  # fmt: skip
@pytest.mark.parametrize("scales", ["tensor", "partition"])
@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "torch"])
def test_the_encode_into_a_send_buffer_writes_the_encodes_bytes_there(shapes, scales, native,
                                                                      monkeypatch):  # fmt: skip
    """A transport hands THC its send buffer (``encode_into``): the native kernel packs the
    indices straight into it, and the payload's field is the buffer itself (no copy); the
    torch path copies. Either way the bytes are the plain encode's, and nothing outside the
    buffer is touched. Fails with a payload packed elsewhere and never copied, a buffer
    written at the wrong offset, or an encode drawing other randomness than ``encode``."""
    monkeypatch.setenv("GRADSUM_NATIVE", native)
    length = sum(math.prod(s) for s in shapes)
    codec = THC(workers=2, scales=scales)
    codec.describe("group", shapes)
    codec.partitions("group", length, 1 << 21)  # one partition of all of them
    x = torch.cat([_random(math.prod(s), seed=i) * 10.0**i for i, s in enumerate(shapes)])
    ctx = CodecContext(seed=5, worker=1, step=2, key=("group", 0))
    shared = codec.summarize(x, ctx)
    expected = codec.encode(x, ctx, shared).fields["indices"]
    buffer = torch.full((expected.numel() + 16,), 0xAB, dtype=torch.uint8)
    out = buffer[8 : 8 + expected.numel()]
    payload = codec.encode_into(x, ctx, shared, out)
    assert torch.equal(out, expected)
    assert torch.equal(payload.fields["indices"], expected)
    assert (buffer[:8] == 0xAB).all() and (buffer[-8:] == 0xAB).all()
    if native == "1":
        assert payload.fields["indices"].data_ptr() == out.data_ptr()
    with pytest.raises(ValueError, match="payload bytes"):
        codec.encode_into(x, ctx, shared, buffer[: expected.numel() - 1])
