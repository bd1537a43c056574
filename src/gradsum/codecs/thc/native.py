"""The optional native CPU path for THC's hot loops (``_kernels.c``); torch is the fallback.

Each function takes torch tensors, checks that the kernel can handle them (extension built, not
disabled, CPU, contiguous, right dtype and size) and returns ``None`` or ``False`` when it can't,
so callers write ``result = native.f(...)`` and fall through to their torch code. Set
``GRADSUM_NATIVE=0`` to force the torch path (read on every call, so tests can flip it).

The kernels draw their stochastic-rounding randomness from their own generator (xoshiro128+
seeded from the worker's seed), so native and torch payloads differ draw by draw but follow the
same distribution; FWHTs agree to float32 rounding, aggregates bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..base import check_finite
from ..native_common import Empty, cpu_ready, fresh
from .switch_kernels import (  # noqa: F401  (the switch's kernels, exported here too)
    MAX_SUM_BITS,
    available,
    lookup_accumulate,
    pack_int32,
)

if TYPE_CHECKING:
    from .hadamard import Rotation

try:
    from . import _kernels
except ImportError:  # built without a C compiler, or on a platform the C code does not support
    _kernels = None

LANES = 8  # the kernels' vector width: FWHT blocks must be at least this long
MAX_GRANULARITY = 4095  # the encode kernel's per-cell table packs grid values in 12 bits


def built() -> bool:
    """Whether the C extension was compiled and imports."""
    return _kernels is not None


def path() -> str:
    """Which of THC's CPU paths runs here (what a benchmark's CPU times depend on most)."""
    if not built():
        return "torch (the C kernels are not built)"
    if not available():
        return "torch (GRADSUM_NATIVE=0)"
    if _kernels.wide():
        return "C kernels, sixteen floats wide (AVX-512)"
    if _kernels.v3():
        return "C kernels, eight floats wide (AVX2)"
    return "C kernels, portable"


def _ready(*tensors: tuple[torch.Tensor, torch.dtype]) -> bool:
    return available() and cpu_ready(*tensors)


def fwht_(x: torch.Tensor, block: int, scale: float) -> bool:
    """x = scale * (unnormalised FWHT of every block of x), in place."""
    if not (_ready((x, torch.float32)) and x.dim() == 1 and block >= LANES):
        return False
    _kernels.fwht(x.data_ptr(), x.numel(), block, scale)
    return True


def rotate(
    x: torch.Tensor, rotation: Rotation, add: torch.Tensor | None = None, empty: Empty = fresh,
    measure: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, float, float, float] | None:  # fmt: skip
    """``rotation.forward(x)`` (+ ``add``, of the padded length) in one fused pass over x: signs
    and scale applied as the transform loads it, ``add`` as each finished leaf is in cache.
    Raises ``NonFiniteGradientError`` for NaN or Inf in x. ``measure``: also the sums of
    squares of the rotated x, of ``add`` (0 without) and of the result, taken from the leaves
    as they are finished (``piece_squares``' order over the padded vector): (out, |R x|^2,
    |add|^2, |out|^2)."""
    if not (_ready((x, torch.float32)) and x.dim() == 1 and _rotation_ready(rotation)):
        return None
    if add is not None and not (_ready((add, torch.float32)) and add.numel() == rotation.padded):
        return None
    out = empty(rotation.padded, torch.float32)
    args = (x.numel(), out.data_ptr(), out.numel(), rotation.block, rotation.sign_bits.data_ptr())
    args += (0 if add is None else add.data_ptr(),)
    if not measure:
        if not _kernels.rotate(x.data_ptr(), *args):
            check_finite(x)  # raises, naming the coordinates
        return out
    finite, rotated, added, total = _kernels.rotate(x.data_ptr(), *args, True)
    if not finite:
        check_finite(x)
    return out, rotated, added, total


def accumulate(
    x: torch.Tensor, e: torch.Tensor, ends: torch.Tensor | None, empty: Empty = fresh
) -> tuple[torch.Tensor, torch.Tensor, float, float] | None:
    """x + e (as torch's add rounds it) and, from the same pass, the sums of squares of every
    piece of it (``ends``: int64, the pieces' ends, the last ``x.numel()``; None: one piece),
    each as ``piece_squares`` adds it, and those of x and of e: (x + e, sums, |x|^2, |e|^2).
    Error feedback's input outside the rotated domain, with its summary and its bound's norms."""
    n = x.numel()
    if not (_ready((x, torch.float32), (e, torch.float32)) and x.dim() == 1
            and e.numel() == n):  # fmt: skip
        return None
    if ends is not None and not (_ready((ends, torch.int64)) and ends.numel() > 0):
        return None
    out = empty(n, torch.float32)
    sums = torch.empty(1 if ends is None else ends.numel(), dtype=torch.float32)
    x_squares, e_squares = _kernels.accumulate(
        x.data_ptr(), e.data_ptr(), out.data_ptr(), n, 0 if ends is None else ends.data_ptr(),
        0 if ends is None else ends.numel(), sums.data_ptr(),
    )  # fmt: skip
    return out, sums, x_squares, e_squares


def encode(
    x: torch.Tensor,
    rotation: Rotation | None,
    a: float,
    c: float,
    granularity: int,
    cells: torch.Tensor,
    seed: int,
    bits: int,
    error: tuple[torch.Tensor, float, float] | None = None,
    empty: Empty = fresh,
    strata: tuple[int, int, int] | None = None,
    own: tuple[float, float] | None = None,
    pieces: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Packed ``bits``-bit table indices of u = clamp(a*y + c, 0, g), stochastically rounded.
    ``strata`` = (the round's shared stratum seed, workers, this worker's rank mod workers):
    correlated rounding's thresholds (``CodecContext.stratified_uniform``), drawn here.

    y is x itself, or ``rotation.forward(x)`` (computed in the rotation's scratch buffer).
    ``cells`` (int32, one per unit cell [i, i + 1) of the grid, i = 0..g, the last repeating
    cell g - 1 for u == g) packs the cell's table interval k, its lower end T[k] and its width
    as k | T[k] << 8 | width << 20. With ``error`` = (e, step, offset), e float32 like x (only
    without a rotation): also e = x - (T[index] * step + offset), each operation rounded as
    torch's elementwise operations round it: x minus what the payload alone decodes to, for
    the decode's ``step`` and ``offset`` (error feedback's memory in the rotated domain). Raises
    ``NonFiniteGradientError`` for NaN or Inf in x, found by the rotation's first pass (or,
    unrotated, as each leaf is read for its rounding).

    ``own`` = (a', c') (only with a rotation): the rotation's scratch is left holding
    a' * T[index] + c', what the payload alone decodes to before its rotation back (a' and c'
    the decode's, of the unnormalised transform), for ``inverse`` to finish.

    ``pieces`` = (ends, divisors) (only with a rotation; int64 and float32, one per piece, the
    last end ``x.numel()``): x scaled by each piece's divisor as the rotation reads it (THC's
    tensor scales) without a divided copy of x: multiplied by a / divisor, one float32 factor
    a piece, instead of divided by the divisor and then multiplied by a (a vector divide costs
    several times the rest of that pass); the same values to a rounding.
    """
    if (own is not None or pieces is not None) and rotation is None:
        return None
    if pieces is not None and not (
        _ready((pieces[0], torch.int64), (pieces[1], torch.float32))
        and pieces[0].numel() == pieces[1].numel()
    ):
        return None
    if error is not None and not (
        rotation is None and _ready((error[0], torch.float32)) and error[0].numel() == x.numel()
    ):
        return None
    if not (
        _ready((x, torch.float32), (cells, torch.int32))
        and bits in (1, 2, 4, 8)
        and granularity <= MAX_GRANULARITY
        and cells.numel() == granularity + 1
    ):
        return None
    buffer, signs, block = x, 0, 0
    if rotation is not None:
        if not _rotation_ready(rotation):
            return None
        buffer, signs, block = rotation.scratch, rotation.sign_bits.data_ptr(), rotation.block
        a /= math.sqrt(block)  # the kernel's transform is unnormalised
    count = buffer.numel()
    out = empty((count * bits + 7) // 8, torch.uint8)
    finite = _kernels.encode(
        x.data_ptr(),
        x.numel(),
        buffer.data_ptr(),
        count,
        block,
        signs,
        a,
        c,
        granularity,
        cells.data_ptr(),
        seed,
        bits,
        out.data_ptr(),
        out.numel(),
        *((0, 0.0, 0.0) if error is None else (error[0].data_ptr(), *error[1:])),
        *((0, 0, 0) if strata is None else strata),
        *((False, 0.0, 0.0) if own is None else (True, *own)),
        *((0, 0, 0) if pieces is None else (pieces[0].data_ptr(), pieces[1].data_ptr(),
                                            pieces[0].numel())),
    )  # fmt: skip
    if not finite:
        check_finite(x)  # raises, naming the coordinates
        return None  # x / divisor overflowed: the caller's torch path divides and reports it
    return out


def inverse(rotation: Rotation) -> torch.Tensor:
    """The rotation's scratch transformed back in place, as the decode does it (unnormalised
    FWHT, then the signs): after ``encode(own=...)``, what the payload decodes to, padded."""
    y = rotation.scratch
    _kernels.inverse(y.data_ptr(), y.numel(), rotation.block, rotation.sign_bits.data_ptr())
    return y


def inverse_residual(
    rotation: Rotation, x: torch.Tensor, pieces: tuple[torch.Tensor, torch.Tensor] | None,
    empty: Empty = fresh,
) -> torch.Tensor | None:  # fmt: skip
    """``residual(x, inverse(rotation), ...)`` without the reconstruction written out: the last
    pass of the transform back stores x - own * factors[p] (``pieces`` = (ends, factors), int64
    and float32, the last end ``x.numel()``; None: x - own) straight into a new tensor, rounded
    as ``residual`` rounds it. The rotation's scratch is left part-transformed."""
    n = x.numel()
    if not (_ready((x, torch.float32)) and x.dim() == 1 and n <= rotation.scratch.numel()):
        return None
    if pieces is not None and not (
        _ready((pieces[0], torch.int64), (pieces[1], torch.float32))
        and pieces[0].numel() == pieces[1].numel() > 0
    ):
        return None
    y, out = rotation.scratch, empty(n, torch.float32)
    _kernels.inverse(y.data_ptr(), y.numel(), rotation.block, rotation.sign_bits.data_ptr(),
                     out.data_ptr(), n, x.data_ptr(),
                     *((0, 0, 0) if pieces is None else (pieces[0].data_ptr(),
                                                         pieces[1].data_ptr(),
                                                         pieces[0].numel())))  # fmt: skip
    return out


def lookup_sum(
    payloads: Sequence[torch.Tensor], bits: int, table: torch.Tensor, count: int, width: int
) -> torch.Tensor | None:
    """Sum over payloads (packed ``bits``-bit indices) of ``table[index]``, packed in ``width``
    bits: the THC aggregator. The caller guarantees that the sums fit the width."""
    packed_in = (count * bits + 7) // 8
    if not (
        _ready((table, torch.int32), *((p, torch.uint8) for p in payloads))
        and bits in (1, 2, 4, 8)
        and width <= MAX_SUM_BITS
        and all(p.numel() >= packed_in for p in payloads)
    ):
        return None
    out = torch.empty((count * width + 7) // 8, dtype=torch.uint8)
    addresses = [p.data_ptr() for p in payloads]
    _kernels.lookup_sum(
        addresses, bits, table.data_ptr(), count, width, out.data_ptr(), out.numel()
    )
    return out


def decode(
    packed: torch.Tensor,
    width: int,
    count: int,
    a: float,
    c: float,
    rotation: Rotation | None,
    empty: Empty = fresh,
    pieces: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """a*S + c for ``count`` packed ``width``-bit sums S, then ``rotation.inverse`` if given
    (returning all ``count`` padded coordinates). ``pieces`` = (ends, factors) (int64 and
    float32, the last end at most ``count``): the values then multiplied by each piece's
    factor as they are stored, as ``scale_pieces`` multiplies them (THC's tensor scales);
    the coordinates past the last end are left undefined."""
    if not (
        _ready((packed, torch.uint8))
        and width <= MAX_SUM_BITS
        and packed.numel() >= (count * width + 7) // 8
    ):
        return None
    if pieces is not None and not (
        _ready((pieces[0], torch.int64), (pieces[1], torch.float32))
        and pieces[0].numel() == pieces[1].numel() > 0
        and int(pieces[0][-1]) <= count
    ):
        return None
    signs, block = 0, 0
    if rotation is not None:
        if not _rotation_ready(rotation):
            return None
        signs, block = rotation.sign_bits.data_ptr(), rotation.block
        a, c = a / math.sqrt(block), c / math.sqrt(block)  # the kernel's transform is unnormalised
    out = empty(count, torch.float32)
    _kernels.decode(
        packed.data_ptr(), packed.numel(), width, count, a, c, out.data_ptr(), block, signs,
        *((0, 0, 0) if pieces is None else (pieces[0].data_ptr(), pieces[1].data_ptr(),
                                            pieces[0].numel())),
    )  # fmt: skip
    return out


def scale_pieces(
    x: torch.Tensor, pieces: tuple[int, ...], lengths: torch.Tensor, factors: torch.Tensor,
    divide: bool, out: torch.Tensor,
) -> bool:  # fmt: skip
    """out = x / factors[p] (``divide``) or x * factors[p] over each piece p of x, ``pieces``
    its lengths (``lengths`` the same as int64): THC's tensor scales, rounded as torch's
    elementwise operations round them. ``out`` may be x."""
    if not (
        _ready((x, torch.float32), (out, torch.float32), (lengths, torch.int64),
               (factors, torch.float32))
        and x.dim() == 1 and out.numel() == x.numel() == sum(pieces)
        and lengths.numel() == factors.numel() == len(pieces)
    ):  # fmt: skip
        return False
    _kernels.scale_pieces(x.data_ptr(), out.data_ptr(), lengths.data_ptr(), factors.data_ptr(),
                          len(pieces), divide)  # fmt: skip
    return True


def residual(
    x: torch.Tensor, own: torch.Tensor, pieces: tuple[int, ...] | None,
    lengths: torch.Tensor | None, factors: torch.Tensor | None, empty: Empty = fresh,
) -> torch.Tensor | None:  # fmt: skip
    """x - own * factors[p] over each piece p of x (``pieces`` its lengths, ``lengths`` the same
    as int64), or x - own without pieces: error feedback's memory outside the rotated domain,
    rounded as torch's scale of ``own`` then subtraction round it, in one pass. ``own`` may be
    longer than x (the padding it drops)."""
    n = x.numel()
    if not (_ready((x, torch.float32), (own, torch.float32)) and x.dim() == 1
            and own.numel() >= n):  # fmt: skip
        return None
    count = 0
    if pieces is not None:
        if not (_ready((lengths, torch.int64), (factors, torch.float32)) and sum(pieces) == n
                and lengths.numel() == factors.numel() == len(pieces)):  # fmt: skip
            return None
        count = len(pieces)
    out = empty(n, torch.float32)
    _kernels.residual_pieces(x.data_ptr(), own.data_ptr(), out.data_ptr(), n,
                             0 if lengths is None else lengths.data_ptr(),
                             0 if factors is None else factors.data_ptr(), count)  # fmt: skip
    return out


def piece_squares(x: torch.Tensor, pieces: tuple[int, ...],
                  lengths: torch.Tensor) -> torch.Tensor | None:  # fmt: skip
    """Every piece's sum of squares (float32) in the kernels' one order, the one every kernel
    that measures a vector on the way uses (``rotate``, ``accumulate``): coordinate k of a
    piece adds its float32 square to lane k % 64 in float32 over spans of 4096 coordinates,
    each span's lane sums are added in float64, the 64 lanes fold pairwise (l + 32, + 16, ...,
    + 1) and the total rounds to float32. Not torch's order (``segment_reduce`` adds one
    square after another, a chain four times slower): a worker's summary is its own, and the
    MAX round hands every worker the same values whichever way each measured them."""
    if not (_ready((x, torch.float32), (lengths, torch.int64)) and x.dim() == 1
            and x.numel() == sum(pieces) and lengths.numel() == len(pieces)):  # fmt: skip
        return None
    sums = torch.empty(len(pieces), dtype=torch.float32)
    _kernels.piece_squares(x.data_ptr(), lengths.data_ptr(), len(pieces), sums.data_ptr())
    return sums


def _rotation_ready(rotation: Rotation) -> bool:
    return rotation.block >= LANES and _ready((rotation.scratch, torch.float32))
