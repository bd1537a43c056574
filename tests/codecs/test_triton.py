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


@pytest.mark.slow  # ~30 s in the interpreter
def test_thc_rounds_through_the_fused_kernels_are_the_torch_paths(kernels, monkeypatch):
    """The codec with the fused kernels (as on a GPU) against its torch path on butterflies:
    every worker's round, error feedback and the all-reduce's unpacked sums included."""
    from functools import partial

    from gradsum.codecs import make_codec, run_round
    from gradsum.codecs.thc import hadamard

    monkeypatch.setenv("GRADSUM_NATIVE", "0")
    monkeypatch.setattr(hadamard, "fwht_", partial(fwht_, dense=False))  # a GPU's torch path
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(5000, generator=generator) for _ in range(3)]

    def rounds(fused: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(kernels, "use_for", lambda device: fused)
        codec = make_codec("thc", workers=3)
        return [run_round(codec, inputs, step=s, seed=4, partition_elements=3000).average
                for s in range(2)]  # fmt: skip

    for fused, torch_path in zip(rounds(True), rounds(False), strict=True):
        assert torch.equal(fused, torch_path)
