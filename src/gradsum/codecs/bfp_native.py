"""The optional native CPU path of block floating point (``_bfp_kernels.c``); torch is the
reference and the fallback.

Each function takes torch tensors, checks that the kernel can handle them (extension built, not
disabled, CPU, contiguous, right dtype and size) and returns ``None`` when it can't, so callers
write ``result = bfp_native.f(...)`` and fall through to their torch code. Set
``GRADSUM_NATIVE=0`` to force the torch path (read on every call, so tests can flip it).

Results are bit-identical to bfp.py's torch code: every step is one IEEE operation on float32
(scales are exact powers of two), and shared exponents that would give a shift the kernels do not
take (not an integer in [-126, 120]) send the call back to torch.

Outputs come from the caller's allocator, in practice a ``buffers.Recycler`` (a buffer of an
earlier call handed out again once nothing refers to it: no page faults on every call).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .base import check_finite
from .buffers import Recycler  # noqa: F401  (the outputs' allocator, see codecs/buffers.py)
from .native_common import Empty, cpu_ready, enabled, fresh

try:
    from . import _bfp_kernels
except ImportError:  # built without a C compiler, or on a platform the C code does not support
    _bfp_kernels = None


def built() -> bool:
    """Whether the C extension was compiled and imports."""
    return _bfp_kernels is not None


def available() -> bool:
    """Whether the native path is in use: built and not disabled by GRADSUM_NATIVE=0."""
    return _bfp_kernels is not None and enabled()


def _ready(*tensors: tuple[torch.Tensor, torch.dtype]) -> bool:
    return available() and cpu_ready(*tensors)


def _blocks(length: int, block: int) -> int:
    return -(-length // block)


def summarize(x: torch.Tensor, block: int) -> torch.Tensor | None:
    """Per block of ``block`` coordinates of x (flattened), the frexp exponent of max |x| as
    float32, ``EXPONENT_FLOOR`` for an all-zero block. Raises ``NonFiniteGradientError`` for NaN
    or Inf in x (the same pass finds them)."""
    if not _ready((x, torch.float32)):
        return None
    exponents = torch.empty(_blocks(x.numel(), block), dtype=torch.float32)
    if not _bfp_kernels.summarize(x.data_ptr(), x.numel(), block, exponents.data_ptr()):
        check_finite(x)  # raises, naming the coordinates
        return None
    return exponents


def encode(
    x: torch.Tensor,
    block: int,
    shared: torch.Tensor,
    headroom: int,
    limit: float,
    empty: Empty = fresh,
) -> torch.Tensor | None:
    """int32 round(clamp(x * 2**shift, -limit, limit)), shift = min(30 - headroom - shared, 120)
    per block (``shared``: one exponent per block). Raises ``NonFiniteGradientError`` for NaN or
    Inf in x."""
    shared = _exponents(shared, _blocks(x.numel(), block))
    if shared is None or not _ready((x, torch.float32)):
        return None
    values = empty(x.numel(), torch.int32)
    status = _bfp_kernels.encode(
        x.data_ptr(), 0, x.numel(), block, shared.data_ptr(), headroom, limit, values.data_ptr()
    )
    if status == 0:
        check_finite(x)  # raises, naming the coordinates
    return values if status == 1 else None


def sum_(
    payloads: Sequence[torch.Tensor], length: int, empty: Empty = fresh
) -> torch.Tensor | None:
    """The int32 sum of ``payloads`` (each at least ``length`` int32), wrapping like torch's."""
    if not (payloads and _ready(*((p, torch.int32) for p in payloads))):
        return None
    if any(p.numel() < length for p in payloads):
        return None
    out = empty(length, torch.int32)
    _bfp_kernels.sum([p.data_ptr() for p in payloads], length, out.data_ptr())
    return out


def decode(
    values: torch.Tensor, length: int, block: int, shared: torch.Tensor, headroom: int,
    contributors: int, empty: Empty = fresh,
) -> torch.Tensor | None:  # fmt: skip
    """float32 values / contributors * 2**-shift for the first ``length`` int32 sums."""
    shared = _exponents(shared, _blocks(length, block))
    if not (
        shared is not None
        and _ready((values, torch.int32))
        and values.numel() >= length
        and 1 <= contributors <= 1 << 24
    ):
        return None
    out = empty(length, torch.float32)
    if not _bfp_kernels.decode(
        values.data_ptr(), 0, length, block, shared.data_ptr(), headroom, contributors,
        out.data_ptr(),
    ):  # fmt: skip
        return None
    return out


class LaneCoder:
    """bfp's ``base.LaneCoder``: any run of a round's coordinates encoded or decoded with the
    kernels of a whole piece (blocks from coordinate 0, each with its shared exponent), so a
    packet's bits are those of ``encode``/``decode`` of the piece it is part of. The pump codes
    with the same kernels in C (``native``: bfp_core.h)."""

    def __init__(self, x: torch.Tensor, shared: torch.Tensor, out: torch.Tensor, block: int,
                 headroom: int, limit: float):  # fmt: skip
        self.x, self.shared, self.out = x, shared, out  # held: the pump reads their addresses
        self.block, self.headroom, self.limit = block, headroom, limit
        self.length = x.numel()
        self.native = {
            "codec": 1, "source": x.data_ptr(), "target": out.data_ptr(),
            "exponents": shared.data_ptr(), "coordinates": self.length, "block": block,
            "headroom": headroom, "limit": limit,
        }  # fmt: skip

    def encode(self, first: int, count: int, into: memoryview) -> None:
        lanes = np.frombuffer(into, dtype=np.int32, count=count)
        real = max(0, min(count, self.length - first))
        lanes[real:] = 0
        if real:  # finiteness: the round's summary has checked these coordinates
            _bfp_kernels.encode(
                self.x.data_ptr(), first, real, self.block, self.shared.data_ptr(),
                self.headroom, self.limit, lanes.ctypes.data,
            )  # fmt: skip

    def decode(self, first: int, count: int, data: memoryview, contributors: int) -> None:
        real = max(0, min(count, self.length - first))
        if real:
            sums = np.frombuffer(data, dtype=np.int32, count=real)
            _bfp_kernels.decode(
                sums.ctypes.data, first, real, self.block, self.shared.data_ptr(),
                self.headroom, contributors, self.out.data_ptr(),
            )  # fmt: skip


def lane_coder(x: torch.Tensor, shared: torch.Tensor | None, out: torch.Tensor, block: int,
               headroom: int, limit: float) -> LaneCoder | None:  # fmt: skip
    """A ``LaneCoder`` over the round's flat ``x`` and ``out``, or None where the kernels can't
    take them (not built, not CPU float32 contiguous, a shift they refuse)."""
    shared = _exponents(shared, _blocks(x.numel(), block))
    if shared is None or not _ready((x, torch.float32), (out, torch.float32)):
        return None
    if out.numel() != x.numel() or not _bfp_kernels.supported(
        shared.data_ptr(), shared.numel(), headroom
    ):
        return None
    return LaneCoder(x, shared, out, block, headroom, limit)


def _exponents(shared: torch.Tensor | None, blocks: int) -> torch.Tensor | None:
    """The shared exponents as a contiguous float32 CPU vector, or None where they can't be."""
    if shared is None or shared.numel() != blocks or shared.device.type != "cpu":
        return None
    if shared.dtype == torch.float32 and shared.dim() == 1 and shared.is_contiguous():
        return shared  # as the exponent round delivers them (no per-part conversions)
    return shared.reshape(-1).to(torch.float32).contiguous()
