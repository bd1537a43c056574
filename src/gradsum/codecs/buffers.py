"""Reusable output buffers for the native kernels: a ``Recycler`` hands out again a buffer of an
earlier call once nothing refers to it any more.

A fresh multi-MiB tensor costs a page fault per 4 KiB page when first written (1024 faults for
4 MiB; ~3 us each on the bench machine, several times the kernels themselves); a recycled one is
already mapped, and often still in cache.
"""

from __future__ import annotations

import sys
import threading

import torch

MAX_LISTED = 64  # buffers listed, held or idle, beyond which the oldest are let go


class Recycler:
    """``empty(count, dtype)`` that hands out buffers of earlier calls nothing refers to any more.

    A buffer counts as unreferenced when the recycler's own references are the only ones: to the
    Python tensor (no payload, list or dict holds it), to its TensorImpl (no view, ``.grad`` or
    other C++ holder) and to its storage (no numpy array or memoryview over it). Where torch or
    Python do not expose those counts, nothing is recycled. Raw ``data_ptr()`` addresses kept
    past the tensor's life are the one thing it cannot see (as with any allocator).

    Buffers of at least ``min_bytes`` are kept, most recently used first. The budget bounds the
    idle ones, those only the recycler holds: when a fresh buffer is made, the oldest idle ones
    are dropped (freed) until the idle ones hold at most ``budget`` bytes, or ``per_request``
    times the size asked for if that is more (a worker alternates between a payload and an
    average, and may still hold the last average). Buffers something else still holds cost the
    recycler nothing and stay listed (up to ``MAX_LISTED`` in all), to be handed out again once
    let go: error feedback's memory of every partition is held from one round to the next, and
    counting it against the budget dropped the round's other buffers, so that every round made
    them afresh. Above glibc's mmap threshold (32 MiB) every fresh buffer faults: 2^24
    coordinates cost ~40 ms of faults per encode here.
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

    def empty_on(self, device: torch.device, count: int, dtype: torch.dtype) -> torch.Tensor:
        """``empty`` on the CPU; a fresh tensor on any other device (whose caching allocator
        already hands memory out again without faulting it in)."""
        if device.type == "cpu":
            return self.empty(count, dtype)
        return torch.empty(count, dtype=dtype, device=device)

    def _take(self, count: int, dtype: torch.dtype, budget: int) -> torch.Tensor:
        kept = self._kept
        for i in range(len(kept) - 1, -1, -1):
            if kept[i].dtype == dtype and kept[i].numel() == count and _unreferenced(kept, i):
                buffer = kept.pop(i)
                kept.append(buffer)
                return buffer
        idle = [i for i in range(len(kept)) if _unreferenced(kept, i)]
        total = sum(kept[i].numel() * kept[i].element_size() for i in idle)
        dropped = set()
        for i in idle:  # oldest first
            if total <= budget:
                break
            dropped.add(i)
            total -= kept[i].numel() * kept[i].element_size()
        excess = len(kept) + 1 - len(dropped) - MAX_LISTED  # the oldest let go: a short scan
        for i in range(len(kept)):
            if excess <= 0:
                break
            if i not in dropped:
                dropped.add(i)
                excess -= 1
        if dropped:
            kept[:] = [t for i, t in enumerate(kept) if i not in dropped]
        buffer = torch.empty(count, dtype=dtype)
        kept.append(buffer)
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
    # the Python count first: a buffer still held (most of those a round scans) is told apart
    # without the storage object and the C++ counts the full comparison makes
    if sys.getrefcount(kept[i]) != _BASELINE[0]:
        return False
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
