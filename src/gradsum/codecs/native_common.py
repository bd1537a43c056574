"""What the native kernel wrappers (``bfp_native``, ``thc/native``, ``thc/switch_kernels``)
share: the ``GRADSUM_NATIVE`` switch, the check that tensors are what the C code can take, and
the allocator type of outputs. Importing it loads no torch (the switch's kernels use it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads with the codecs that use it, not with the switch's kernels
    import torch

Empty = Callable[[int, "torch.dtype"], "torch.Tensor"]  # where outputs come from (Recycler)


def fresh(count: int, dtype: torch.dtype) -> torch.Tensor:
    import torch

    return torch.empty(count, dtype=dtype)


def enabled() -> bool:
    """False under GRADSUM_NATIVE=0 (read on every call, so tests can flip it)."""
    return os.environ.get("GRADSUM_NATIVE", "1") != "0"


def cpu_ready(*tensors: tuple[torch.Tensor, torch.dtype]) -> bool:
    """Every tensor is on the CPU, contiguous, of its dtype."""
    for t, dtype in tensors:  # noqa: SIM110 (no generator: called several times per kernel)
        if not (t.is_cpu and t.dtype == dtype and t.is_contiguous()):
            return False
    return True
