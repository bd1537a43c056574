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


def quantize(y: torch.Tensor, draws: torch.Tensor | int, lookups, a, c, granularity: int,
             bits: int) -> torch.Tensor:  # fmt: skip
    """Packed table indices of clamp(y * a + c, 0, g), rounded with ``draws`` (float32 a and c,
    Python floats or 0-d tensors; one value each); ``draws`` an int: the seed of
    ``base.hashed_uniform``'s thresholds, computed in the kernel."""
    if not quantizes(y.numel(), bits):
        raise ValueError(f"quantize takes {bits}-bit lanes of a power-of-two length")
    per, n = 8 // bits, min(TILE, y.numel())
    packed = torch.empty(y.numel() // per, dtype=torch.uint8, device=y.device)
    hashed = isinstance(draws, int)
    seed = draws if hashed else 0
    _kernels()._quantize_kernel[(y.numel() // n,)](
        y, y if hashed else draws, lookups.low_of_cell, lookups.inverse_width_of_cell,
        lookups.interval_of_cell, packed, _scalar(a, y.device), _scalar(c, y.device),
        seed & 0xFFFFFFFF, seed >> 32, g=granularity, BITS=bits, N=n, HASHED=hashed,
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


# -- a step's rows (``thc.step``) ----------------------------------------------------------------
def rows_fit(padded: int, bits: int) -> bool:
    """Whether the row kernels take a step whose rows are at most ``padded`` long (a power of
    two) in lanes of ``bits`` bits; every row's padded length must also be a whole number of
    packed bytes (``StepLayout``)."""
    tile = min(TILE, padded)
    return bits in (1, 2, 4, 8) and tile % (8 // bits) == 0 and padded // tile <= 1024


def _row_tiles(n: int) -> tuple[int, int]:
    tile = min(TILE, n)
    return tile, tile.bit_length() - 1


def rows_rotate(layout, src: torch.Tensor, memory: torch.Tensor | None,
                norms: torch.Tensor | None, bound: float | None, feedback: bool,
                divisors: torch.Tensor | None = None, select: int = 0,
                out: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Every row's rotation input (``_rows_rotate_kernel``) through both kernels: the rotated
    rows [P, N] and, under error ``feedback``, the rows x + e of gradient-domain memory (laid
    out as ``src``), e the rows of ``memory`` where given; ``norms``: the rows' input and
    memory norms, for ``bound``; ``divisors``: every piece's tensor scale (``layout``'s);
    ``select``: which rows (``_triton._selected``), into ``out`` where given."""
    p, n = layout.rows, layout.width
    tile, log_tile = _row_tiles(n)
    if out is None:
        out = torch.empty(p, n, dtype=torch.float32, device=src.device)
    xp = torch.empty_like(src) if feedback else None
    dummy = out
    factor = 0.0 if bound is None else float(bound)
    options = _launch_options()
    kernels = _kernels()
    kernels._rows_rotate_kernel[(p, n // tile)](
        src, dummy if memory is None else memory, dummy if norms is None else norms,
        dummy if xp is None else xp, out, layout.signs, layout.meta, layout.scales, factor,
        dummy if divisors is None else divisors, layout.piece_lengths, p, n,
        K=layout.meta.shape[1], T=tile,
        LOG_T=log_tile, XP=feedback, MEMORY=memory is not None, BOUND=norms is not None,
        PIECES=divisors is not None, SELECT=select, **options,
    )  # fmt: skip
    if n > tile and layout.spans(select):
        rows = n // tile
        kernels._rows_cross_kernel[(p, tile // COLUMNS)](
            out, dummy if memory is None else memory, dummy if norms is None else norms,
            layout.signs, layout.meta, layout.scales, dummy, dummy, factor, dummy,
            layout.piece_lengths, p, n,
            K=layout.meta.shape[1], RM=rows, LOG_RM=rows.bit_length() - 1, T=tile,
            LOG_T=log_tile, C=COLUMNS, DECODE=False, MEMORY=memory is not None,
            BOUND=norms is not None, RESIDUAL=False, PIECES=False, SELECT=select, **options,
        )  # fmt: skip
    return out, xp


def rows_quantize(layout, y: torch.Tensor, seeds: torch.Tensor, lookups, a: torch.Tensor,
                  c: float, granularity: int, bits: int,
                  error: tuple | None = None) -> torch.Tensor:  # fmt: skip
    """Every row's packed indices [P, N * bits / 8] (``_rows_quantize_kernel``); ``error``:
    (values, step, offset, out), the rows of rotated memory's new memory into ``out``."""
    p, n = layout.rows, layout.width
    tile = min(TILE, n)
    packed = torch.empty(p, n * bits // 8, dtype=torch.uint8, device=y.device)
    dummy = y
    values, step, offset, out = (dummy,) * 4 if error is None else error
    _kernels()._rows_quantize_kernel[(p, n // tile)](
        y, seeds, lookups.low_of_cell, lookups.inverse_width_of_cell, lookups.interval_of_cell,
        packed, a, c, layout.meta, values, step, offset, out, n, K=layout.meta.shape[1],
        g=granularity, BITS=bits, NT=tile, ERROR=error is not None, **_launch_options(),
    )  # fmt: skip
    return packed


def rows_dequantize_inverse(layout, sums: torch.Tensor, width: int, step: torch.Tensor,
                            offset: torch.Tensor, contributors: int, out: torch.Tensor,
                            values: torch.Tensor | None = None,
                            xp: torch.Tensor | None = None,
                            factors: torch.Tensor | None = None) -> None:  # fmt: skip
    """Every row's decode into ``out``: the step's flat output (each row's first LEN at OUT),
    or with ``xp`` the new gradient-domain memory x + e - decoded, [P, N]. ``values``: the
    sums are table indices packed at a row stride of N * width / 8 (a payload's own sum);
    ``factors``: every piece's tensor scale (``layout``'s)."""
    p, n = layout.rows, layout.width
    tile, log_tile = _row_tiles(n)
    buf = torch.empty(p, n, dtype=torch.float32, device=sums.device)
    dummy = buf
    residual = xp is not None
    options = _launch_options()
    kernels = _kernels()
    kernels._rows_dequantize_kernel[(p, n // tile)](
        sums, buf, step, offset, dummy if values is None else values, layout.signs,
        layout.meta, layout.scales, dummy if xp is None else xp, out,
        dummy if factors is None else factors, layout.piece_lengths, contributors, n,
        K=layout.meta.shape[1], T=tile,
        LOG_T=log_tile, WIDTH=width, LOOKUP=values is not None, RESIDUAL=residual,
        PIECES=factors is not None, **options,
    )  # fmt: skip
    if n > tile:
        rows = n // tile
        kernels._rows_cross_kernel[(p, tile // COLUMNS)](
            buf, dummy, dummy, layout.signs, layout.meta, layout.scales,
            dummy if xp is None else xp, out, 0.0, dummy if factors is None else factors,
            layout.piece_lengths, p, n,
            K=layout.meta.shape[1], RM=rows, LOG_RM=rows.bit_length() - 1, T=tile,
            LOG_T=log_tile, C=COLUMNS, DECODE=True, MEMORY=False, BOUND=False,
            RESIDUAL=residual, PIECES=factors is not None, SELECT=0, **options,
        )  # fmt: skip


def rows_scalars(shared: torch.Tensor, sqrt_padded: torch.Tensor, constants: torch.Tensor,
                 prior: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Every row's grid scalars (``_rows_scalars_kernel``) from its max norm (float32 or 64):
    a, step (float64), step, offset and own offset (float32), and whether the row's max norm
    is valid and ``prior`` holds (int8)."""
    p, device = shared.numel(), shared.device
    block = min(1024, 1 << max(0, p - 1).bit_length())
    f32 = lambda: torch.empty(p, dtype=torch.float32, device=device)  # noqa: E731
    a, step32, offset, own = f32(), f32(), f32(), f32()
    step = torch.empty(p, dtype=torch.float64, device=device)
    ok = torch.empty(p, dtype=torch.int8, device=device)
    _kernels()._rows_scalars_kernel[(-(-p // block),)](
        shared, sqrt_padded, constants, a, step, step32, offset, own, ok,
        ok if prior is None else prior, p, BLOCK=block, PRIOR=prior is not None,
        **_launch_options(),
    )  # fmt: skip
    return a, step, step32, offset, own, ok


def rows_tensor_scales(layout, shared: torch.Tensor, workers: int) -> tuple[torch.Tensor, ...]:
    """Every row's tensor scales (``_rows_tensor_scales_kernel``): its largest normalized norm
    (float64), every piece's decode factor and encode divisor (float32), and whether the
    row's norms are valid (int8)."""
    p, q, device = layout.rows, layout.pieces, shared.device
    largest = torch.empty(p, dtype=torch.float64, device=device)
    factors = torch.empty(q, dtype=torch.float32, device=device)
    divisors = torch.empty(q, dtype=torch.float32, device=device)
    ok = torch.empty(p, dtype=torch.int8, device=device)
    _kernels()._rows_tensor_scales_kernel[(p,)](
        shared, layout.meta, layout.sqrt_lengths, largest, factors, divisors, ok,
        layout.plain, q, workers, K=layout.meta.shape[1],
        WB=1 << max(0, workers - 1).bit_length(), **_launch_options(),
    )  # fmt: skip
    return largest, factors, divisors, ok
