"""The optional native CPU path of block floating point (``_bfp_kernels.c``); torch is the
reference and the fallback.

Each function takes torch tensors, checks that the kernel can handle them (extension built, not
disabled, CPU, contiguous, right dtype and size) and returns ``None`` when it can't, so callers
write ``result = bfp_native.f(...)`` and fall through to their torch code. Set
``GRADSUM_NATIVE=0`` to force the torch path (read on every call, so tests can flip it).

Results are bit-identical to bfp.py's torch code: every step is one IEEE operation on float32
(scales are exact powers of two), and shared exponents that would give a shift the kernels do not
take (not an integer in [-126, 120]) send the call back to torch.

Outputs come from a ``Recycler``: a buffer of an earlier call is handed out again once nothing
refers to it any more. A fresh multi-MiB tensor costs a page fault per 4 KiB page when first
written (1024 faults for 2^20 int32; measured ~3 us each on the bench machine, several times the
kernel itself); a recycled one is already mapped, and often still in cache.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence

import torch

from .base import check_finite

try:
    from . import _bfp_kernels
except ImportError:  # built without a C compiler, or on a platform the C code does not support
    _bfp_kernels = None


def built() -> bool:
    """Whether the C extension was compiled and imports."""
    return _bfp_kernels is not None


def available() -> bool:
    """Whether the native path is in use: built and not disabled by GRADSUM_NATIVE=0."""
    return _bfp_kernels is not None and os.environ.get("GRADSUM_NATIVE", "1") != "0"


def _ready(*tensors: tuple[torch.Tensor, torch.dtype]) -> bool:
    return available() and all(
        t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t, dtype in tensors
    )


Empty = Callable[[int, torch.dtype], torch.Tensor]


def _fresh(count: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(count, dtype=dtype)


class Recycler:
    """``empty(count, dtype)`` that hands out buffers of earlier calls nothing refers to any more.

    A buffer counts as unreferenced when the recycler's own references are the only ones: to the
    Python tensor (no payload, list or dict holds it), to its TensorImpl (no view, ``.grad`` or
    other C++ holder) and to its storage (no numpy array or memoryview over it). Where torch or
    Python do not expose those counts, nothing is recycled. Raw ``data_ptr()`` addresses kept
    past the tensor's life are the one thing it cannot see (as with any allocator).

    Buffers of at least ``min_bytes`` are kept, most recently used first, up to ``budget`` bytes
    in all, or ``per_request`` times the size asked for if that is more (a worker alternates
    between a payload and an average, and may still hold the last average); older ones are
    dropped (freed, or left to whoever still holds them). Above glibc's mmap threshold (32 MiB)
    every fresh buffer faults: 2^24 coordinates cost ~40 ms of faults per encode here.
    """

    def __init__(self, budget: int = 64 << 20, min_bytes: int = 256 << 10, per_request: int = 4):
        self.budget, self.min_bytes, self.per_request = budget, min_bytes, per_request
        self._kept: list[torch.Tensor] = []  # most recently handed out last
        self._lock = threading.Lock()

    def empty(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = count * dtype.itemsize
        if nbytes < self.min_bytes or _BASELINE is None:
            return torch.empty(count, dtype=dtype)
        with self._lock:
            return self._take(count, dtype, max(self.budget, self.per_request * nbytes))

    def _take(self, count: int, dtype: torch.dtype, budget: int) -> torch.Tensor:
        kept = self._kept
        for i in range(len(kept) - 1, -1, -1):
            if kept[i].dtype == dtype and kept[i].numel() == count and _unreferenced(kept, i):
                buffer = kept.pop(i)
                kept.append(buffer)
                return buffer
        buffer = torch.empty(count, dtype=dtype)
        kept.append(buffer)
        total = sum(t.numel() * t.element_size() for t in kept)
        while total > budget:
            dropped = kept.pop(0)
            total -= dropped.numel() * dropped.element_size()
        return buffer

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()

    def __getstate__(self) -> dict:  # a copied or pickled codec starts with no buffers
        return {"budget": self.budget, "min_bytes": self.min_bytes, "per_request": self.per_request}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)


def _counts(kept: list[torch.Tensor], i: int) -> tuple[int, int, int, int]:
    """(Python references to kept[i], to its TensorImpl, to its StorageImpl, to the storage's
    Python object), as seen from here."""
    storage = kept[i].untyped_storage()
    return (
        sys.getrefcount(kept[i]),
        kept[i]._use_count(),
        torch._C._storage_Use_Count(storage._cdata),
        sys.getrefcount(storage),
    )


def _unreferenced(kept: list[torch.Tensor], i: int) -> bool:
    try:
        return _counts(kept, i) == _BASELINE
    except (AttributeError, RuntimeError, TypeError):  # a torch without these counts
        return False


def _calibrate() -> tuple[int, int, int, int] | None:
    """The counts of a tensor only a recycler list holds (they vary with Python and torch); None
    where some reference from elsewhere would not change them, so recycling stays off."""
    holders = (
        lambda t: t,  # a payload, list or variable
        lambda t: t[:1],  # a view
        lambda t: t.reshape(1),  # what collective.allreduce returns
        lambda t: t.numpy(),
        lambda t: memoryview(t.numpy()),  # what the transport sends from
        lambda t: t.untyped_storage(),
        _as_grad,  # a C++ holder
    )
    try:
        alone = [torch.empty(1)]
        baseline = _counts(alone, 0)
        for hold in holders:
            reference = hold(alone[0])
            if _counts(alone, 0) == baseline:
                return None
            del reference
        return baseline if _counts(alone, 0) == baseline else None
    except (AttributeError, RuntimeError, TypeError):
        return None


def _as_grad(t: torch.Tensor) -> torch.Tensor:
    parameter = torch.zeros(t.shape, requires_grad=True)
    parameter.grad = t
    return parameter


_BASELINE = _calibrate()


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
    empty: Empty = _fresh,
) -> torch.Tensor | None:
    """int32 round(clamp(x * 2**shift, -limit, limit)), shift = min(30 - headroom - shared, 120)
    per block (``shared``: one exponent per block). Raises ``NonFiniteGradientError`` for NaN or
    Inf in x."""
    shared = _exponents(shared, _blocks(x.numel(), block))
    if shared is None or not _ready((x, torch.float32)):
        return None
    values = empty(x.numel(), torch.int32)
    status = _bfp_kernels.encode(
        x.data_ptr(), x.numel(), block, shared.data_ptr(), headroom, limit, values.data_ptr()
    )
    if status == 0:
        check_finite(x)  # raises, naming the coordinates
    return values if status == 1 else None


def sum_(
    payloads: Sequence[torch.Tensor], length: int, empty: Empty = _fresh
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
    contributors: int, empty: Empty = _fresh,
) -> torch.Tensor | None:  # fmt: skip
    """float32 values * (2**-shift / contributors) for the first ``length`` int32 sums."""
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
        values.data_ptr(), length, block, shared.data_ptr(), headroom, contributors,
        out.data_ptr(),
    ):  # fmt: skip
        return None
    return out


def _exponents(shared: torch.Tensor | None, blocks: int) -> torch.Tensor | None:
    """The shared exponents as a contiguous float32 CPU vector, or None where they can't be."""
    if shared is None or shared.numel() != blocks or shared.device.type != "cpu":
        return None
    return shared.reshape(-1).to(torch.float32).contiguous()
