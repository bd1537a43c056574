"""Fused Triton kernels for THC on a GPU: the FWHT, the encode and the decode in two launches.

The torch path runs a rotation as ~2 kernels per butterfly stage (40 for a 2**20 partition) and
the encode's scale, clamp, lookups, rounding and packing as ~15 more. Here a transform of
``block`` coordinates is at most two kernels: one runs every stage inside tiles of ``TILE``
coordinates, the next every stage across tiles (a column of ``block / TILE`` values per
position), and the encode's and decode's elementwise work is fused into the first load or the
last store. Each coordinate sees the torch path's operations in the torch path's order — the
butterflies smallest stride first, then ``* 1/sqrt(B)``, ``* a``, ``+ c`` each rounded to float32
(``enable_fp_fusion=False`` keeps the compiler from contracting them into FMAs) — so the results
are the torch path's bit for bit: ``tests/codecs/test_triton.py`` checks that on the CPU under
``TRITON_INTERPRET=1``. The torch path (``hadamard.fwht_`` without its CPU matmul, and
``GridCodec._round_to_table``) stays the reference and the fallback; Triton is an optional
extra (``pip install gradsum[gpu]``).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch

TILE = 1 << 12  # coordinates per tile of the in-tile stages (16 KiB of float32)
COLUMNS = 16  # positions per program of the cross-tile stages
MAX_BLOCK = TILE * 1024  # a block of up to 2**22 coordinates: two kernels


def available(device: torch.device | str) -> bool:
    """Triton is installed and can run on ``device``: a GPU, or the CPU under the
    interpreter (``TRITON_INTERPRET=1``, what the tests use)."""
    if importlib.util.find_spec("triton") is None or os.environ.get("GRADSUM_TRITON") == "0":
        return False
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def quantizes(count: int, bits: int) -> bool:
    """Whether ``quantize`` takes ``count`` coordinates in lanes of ``bits`` bits: whole
    programs of ``min(TILE, count)`` coordinates, each a whole number of bytes."""
    n = min(TILE, count)
    return bits in (1, 2, 4, 8) and count > 0 and count % n == 0 and n % (8 // bits) == 0


def fits(padded: int, block: int, bits: int) -> bool:
    """Whether the fused kernels take a rotation of this shape and lane width."""
    if not quantizes(padded, bits) or block & (block - 1) or block > MAX_BLOCK:
        return False
    return block <= TILE or block % TILE == 0


def use_for(device: torch.device) -> bool:
    """The codec's choice: the fused kernels on a GPU where Triton is installed."""
    return device.type == "cuda" and available(device)


@functools.cache
def _kernels():
    """The kernels' module, imported on first use (see ``_triton.py``)."""
    from . import _triton

    return _triton


def _scalar(value, device: torch.device) -> torch.Tensor:
    """A float32 scalar in device memory, which the kernel loads (a 0-d tensor is never read
    on the host: no sync)."""
    if isinstance(value, torch.Tensor):
        return value.reshape(1).to(torch.float32)
    return torch.full((1,), value, dtype=torch.float32, device=device)


def _launch_options() -> dict:
    """No FMA contraction (the torch path rounds a product before it adds); the interpreter
    takes no compiler options."""
    return {} if os.environ.get("TRITON_INTERPRET") == "1" else {"enable_fp_fusion": False}


def _check_block(block: int) -> None:
    if block & (block - 1) or not 1 <= block <= MAX_BLOCK or (block > TILE and block % TILE):
        raise ValueError(f"the Triton FWHT takes power-of-two blocks to {MAX_BLOCK}, not {block}")


def _transform(out: torch.Tensor, block: int, scale: float, load: int, src=None, signs=None,
               sums=None, length: int = 0, a=None, c=None,
               width: int = 0) -> torch.Tensor:  # fmt: skip
    """The FWHT of every block of ``out`` (whose first kernel loads per ``load``), in place.
    ``length``: of the input (encode), or the packed sums' bytes (decode, ``width`` > 0)."""
    _check_block(block)
    tile = min(block, TILE)
    dummy = out
    options = _launch_options()
    kernels = _kernels()
    kernels._tile_kernel[(out.numel() // tile,)](
        dummy if src is None else src, out, dummy if signs is None else signs,
        dummy if sums is None else sums, length or out.numel(), scale,
        dummy if a is None else a, dummy if c is None else c,
        T=tile, LOG_T=tile.bit_length() - 1, LOAD=load, LAST=block == tile, WIDTH=width,
        **options,
    )  # fmt: skip
    if block > tile:
        rows = block // tile
        kernels._cross_kernel[(out.numel() // block, tile // COLUMNS)](
            out, dummy if signs is None else signs, scale, R=rows, LOG_R=rows.bit_length() - 1,
            T=tile, C=COLUMNS, SIGNS=load == 2, **options,
        )  # fmt: skip
    return out


def fwht(x: torch.Tensor, block: int) -> torch.Tensor:
    """The orthonormal FWHT of every block of ``x`` (a new tensor): ``hadamard.fwht_`` on
    butterflies, bit for bit."""
    x = x.contiguous()
    return _transform(torch.empty_like(x), block, 1.0 / math.sqrt(block), 0, src=x)


def rotate(x: torch.Tensor, signs: torch.Tensor, padded: int, block: int) -> torch.Tensor:
    """``Rotation.forward``: x (its length) times the signs, zero-padded, transformed."""
    out = torch.empty(padded, dtype=torch.float32, device=x.device)
    return _transform(out, block, 1.0 / math.sqrt(block), 1, src=x.contiguous(), signs=signs,
                      length=x.numel())  # fmt: skip


def quantize(y: torch.Tensor, draws: torch.Tensor, lookups, a, c, granularity: int,
             bits: int) -> torch.Tensor:  # fmt: skip
    """Packed table indices of clamp(y * a + c, 0, g), rounded with ``draws`` (float32 a and c,
    Python floats or 0-d tensors; one value each)."""
    if not quantizes(y.numel(), bits):
        raise ValueError(f"quantize takes {bits}-bit lanes of a power-of-two length")
    per, n = 8 // bits, min(TILE, y.numel())
    packed = torch.empty(y.numel() // per, dtype=torch.uint8, device=y.device)
    _kernels()._quantize_kernel[(y.numel() // n,)](
        y, draws, lookups.low_of_cell, lookups.inverse_width_of_cell, lookups.interval_of_cell,
        packed, _scalar(a, y.device), _scalar(c, y.device), g=granularity, BITS=bits, N=n,
        **_launch_options(),
    )  # fmt: skip
    return packed


MAX_PACKED_WIDTH = 25  # a lane then spans at most four bytes (``_triton._packed_lanes``)


def dequantize_inverse(sums: torch.Tensor, signs: torch.Tensor, block: int, a, c,
                       count: int | None = None, width: int = 0) -> torch.Tensor:  # fmt: skip
    """``Rotation.inverse(sums * a + c)`` over the padded length: ``sums`` one integer per lane
    (``width`` 0), or ``count`` lanes of ``width`` bits packed as ``bits.pack_bits`` packs them,
    unpacked as the first kernel loads them (the ~20 launches of ``unpack_bits`` saved)."""
    if width:
        if not 1 <= width <= MAX_PACKED_WIDTH or count is None:
            raise ValueError(f"packed sums take widths 1..{MAX_PACKED_WIDTH} and a count")
        if sums.dtype != torch.uint8 or sums.numel() * 8 < count * width:
            raise ValueError(f"{count} lanes of {width} bits need {count * width / 8:g} bytes")
    else:
        count = sums.numel()
    out = torch.empty(count, dtype=torch.float32, device=sums.device)
    return _transform(out, block, 1.0 / math.sqrt(block), 2, signs=signs, sums=sums.contiguous(),
                      length=sums.numel() if width else 0, a=_scalar(a, sums.device),
                      c=_scalar(c, sums.device), width=width)  # fmt: skip
