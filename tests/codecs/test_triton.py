"""The fused Triton kernels agree bit for bit with the torch path they replace on a GPU (the
butterflies, without the CPU's matmul), run on the CPU by Triton's interpreter. Tiles are
shrunk so both kernels of a transform (in-tile and cross-tile stages) run at test sizes."""

import math
import os
import sys

import pytest

# Triton reads TRITON_INTERPRET when it defines its own functions (tl.zeros and the like), so
# it must be set before the first import of triton in this process (gradsum imports it only
# when a kernel first runs).
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported without TRITON_INTERPRET=1", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

import torch

from gradsum.codecs.base import CodecContext
from gradsum.codecs.bits import pack_bits
from gradsum.codecs.thc.codec import THC, _divide, _float32
from gradsum.codecs.thc.hadamard import Rotation, fwht_


@pytest.fixture
def kernels(monkeypatch):
    from gradsum.codecs.thc import triton_kernels

    monkeypatch.setattr(triton_kernels, "TILE", 64)
    monkeypatch.setattr(triton_kernels, "COLUMNS", 8)
    return triton_kernels


def butterflies(x: torch.Tensor, block: int) -> torch.Tensor:
    return fwht_(x.clone(), block, dense=False)


@pytest.mark.parametrize(("block", "count"), [(1, 4), (8, 64), (64, 192), (1024, 2048)])
def test_fwht_matches_the_butterflies_bit_for_bit(kernels, block, count):
    x = torch.randn(count, generator=torch.Generator().manual_seed(block))
    assert torch.equal(kernels.fwht(x, block), butterflies(x, block))


@pytest.mark.parametrize("correlated", [False, True], ids=["independent", "correlated"])
@pytest.mark.parametrize("length", [5, 1000, 4096])
def test_thc_encode_matches_the_torch_path_bit_for_bit(kernels, length, correlated):
    codec = THC(workers=3, correlated=correlated)
    g = codec.granularity
    x = torch.randn(length, generator=torch.Generator().manual_seed(length))
    ctx = CodecContext(seed=1, worker=2, step=3)
    rotation = Rotation(length, None, ctx.shared_seed(), "cpu")
    rotated = kernels.rotate(x, rotation.signs, rotation.padded, rotation.block)
    padded = torch.zeros(rotation.padded)
    padded[:length] = x * rotation.signs[:length]
    assert torch.equal(rotated, butterflies(padded, rotation.block))

    # one worker's norm (in its slot of the spread clamp's): the clamp at equal norms
    max_norm = codec.summarize(x, ctx).amax().to(torch.float64)
    a = _float32(codec._grid_scale(max_norm, rotation.padded, codec.threshold))
    draws = torch.empty(rotation.padded)
    codec._draw(ctx, rotation.padded, x.device, draws)  # stratified where correlated
    got = kernels.quantize(rotated, draws, codec._tables(x.device), a, g / 2, g, codec.bits)
    u = rotated.mul(a).add_(g / 2).clamp_(0, g)
    want = pack_bits(codec._round_to_table(u, ctx), codec.bits, check=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("length", [5, 1000, 4096])
def test_thc_decode_matches_the_torch_path_bit_for_bit(kernels, length):
    codec = THC(workers=3)
    rotation = Rotation(length, None, CodecContext().shared_seed(), "cpu")
    sums = torch.randint(0, 91, (rotation.padded,), generator=torch.Generator().manual_seed(7),
                         dtype=torch.int32).to(torch.uint8)  # fmt: skip
    step = codec._step(torch.tensor(2.5, dtype=torch.float64), rotation.padded, codec.threshold)
    a, c = _float32(_divide(step, 3)), _float32(-step * 30 / 2)
    got = kernels.dequantize_inverse(sums, rotation.signs, rotation.block, a, c)[:length]
    y = butterflies(sums.to(torch.float32).mul_(a).add_(c), rotation.block)
    assert torch.equal(got, y[:length].mul_(rotation.signs[:length]))
    assert math.isfinite(float(got.abs().max()))


@pytest.mark.parametrize("width", [1, 3, 7, 8, 11, 16, 25])
@pytest.mark.parametrize("length", [5, 1000])
def test_packed_sums_decode_as_their_unpacked_lanes(kernels, width, length):
    """The decode's kernel reads ``pack_bits``' lanes itself, the last lane's bytes included."""
    rotation = Rotation(length, None, CodecContext().shared_seed(), "cpu")
    generator = torch.Generator().manual_seed(width)
    sums = torch.randint(0, 1 << width, (rotation.padded,), generator=generator)
    sums[:2] = torch.tensor([0, (1 << width) - 1])  # both ends of the width
    packed = pack_bits(sums, width)
    a, c = torch.tensor(0.03125), torch.tensor(-1.5)
    got = kernels.dequantize_inverse(packed, rotation.signs, rotation.block, a, c,
                                     rotation.padded, width)  # fmt: skip
    want = kernels.dequantize_inverse(sums.to(torch.int32), rotation.signs, rotation.block, a, c)
    assert torch.equal(got, want)


def test_packed_sums_of_an_impossible_width_or_size_are_refused(kernels):
    signs = torch.ones(8)
    with pytest.raises(ValueError, match=r"widths 1\.\.25"):
        kernels.dequantize_inverse(torch.zeros(32, dtype=torch.uint8), signs, 8, 1.0, 0.0, 8, 26)
    with pytest.raises(ValueError, match="8 lanes of 9 bits need 9 bytes"):
        kernels.dequantize_inverse(torch.zeros(8, dtype=torch.uint8), signs, 8, 1.0, 0.0, 8, 9)


@pytest.mark.slow  # a few seconds each in the interpreter
@pytest.mark.parametrize(
    ("name", "length", "partition"),
    # two partitions, each padded (300 -> 512, 200 -> 256) and across tiles of 64 (8 and 4 in a
    # block: several cross-tile stages); unrotated, two partitions of whole tiles (4 and 2)
    [("thc", 500, 300), ("thc-uniform", 500, 300), ("thc-uniform-unrotated", 384, 256)],
)
def test_thc_rounds_through_the_fused_kernels_are_the_torch_paths(
    kernels, monkeypatch, name, length, partition
):
    """The codec with the fused kernels (as on a GPU) against its torch path on butterflies:
    every worker's round, error feedback (its rotation of x + e and its own values) and the
    packed sums' decode included; unrotated, the fused rounding alone (whole tiles)."""
    from functools import partial

    from gradsum.codecs import make_codec, run_round
    from gradsum.codecs.thc import hadamard

    monkeypatch.setenv("GRADSUM_NATIVE", "0")
    monkeypatch.setattr(hadamard, "fwht_", partial(fwht_, dense=False))  # a GPU's torch path
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(length, generator=generator) for _ in range(3)]

    quantize = kernels.quantize

    def rounds(fused: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(kernels, "use_for", lambda device: fused)
        launched = []

        def counted(*args, **kwargs):
            launched.append(1)
            return quantize(*args, **kwargs)

        monkeypatch.setattr(kernels, "quantize", counted)
        codec = make_codec(name, workers=3)
        averages = [run_round(codec, inputs, step=s, seed=4, partition_elements=partition).average
                    for s in range(2)]  # fmt: skip
        assert bool(launched) == fused  # the fused rounding ran where, and only where, asked
        return averages

    for fused, torch_path in zip(rounds(True), rounds(False), strict=True):
        assert torch.equal(fused, torch_path)


@pytest.mark.parametrize("described", [True, False], ids=["tensor-scales", "padded"])
def test_error_feedbacks_own_values_decode_the_payload_alone_as_its_packed_sum(
    kernels, monkeypatch, described
):
    """Error feedback's reconstruction on a GPU's path decodes the payload's table values as an
    unpacked sum of one contributor; the packed sum's decode (``reconstruct``) gives the same
    bits through the fused kernels."""
    monkeypatch.setenv("GRADSUM_NATIVE", "0")
    monkeypatch.setattr(kernels, "use_for", lambda device: True)
    codec = THC(workers=3)
    length = 300  # padded to 512: 8 tiles of 64, both kernels of each transform
    if described:
        codec.describe("k", [(200,), (100,)])
        codec.partitions("k", length, 1 << 20)
    ctx = CodecContext(seed=1, worker=1, step=2, partition=0, key=("k", 0))
    x = torch.randn(length, generator=torch.Generator().manual_seed(5))
    x[200:] *= 1e-3
    shared = codec.summarize(x, ctx) * 1.5  # another worker's larger norms
    payload = codec.encode(x, ctx, shared)
    want = codec.reconstruct(payload, ctx, shared)
    got_payload, got = codec.encode_and_reconstruct(x, ctx, shared)
    assert torch.equal(got_payload.fields["indices"], payload.fields["indices"])
    assert torch.equal(got, want)
