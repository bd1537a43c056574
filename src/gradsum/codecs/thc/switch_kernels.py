"""THC's kernels that run in a switch's slots, on the data plane's numpy arrays: table lookup and
accumulation of packed indices, and packing of the int32 sums for the downstream. Importing this
loads no torch (``gradsum switch`` needs nothing else from the codecs); ``native`` has the
worker's kernels and re-exports these."""

from __future__ import annotations

import numpy as np

from ..lanes import packed_nbytes
from ..native_common import enabled

try:
    from . import _kernels
except ImportError:  # built without a C compiler, or on a platform the C code does not support
    _kernels = None

MAX_SUM_BITS = 16  # widest downstream sum the aggregator kernel packs


def available() -> bool:
    """Whether the native path is in use: built and not disabled by GRADSUM_NATIVE=0."""
    return _kernels is not None and enabled()


def lookup_accumulate(
    acc: np.ndarray, payload, count: int, bits: int, table: np.ndarray, first: bool
) -> bool:
    """acc[:count] = (first) or += table[index] of ``count`` packed ``bits``-bit indices in
    ``payload`` (bytes-like); int32 acc and table. False where the kernel cannot run."""
    if not (
        available()
        and bits in (1, 2, 4, 8)
        and _int32_array(acc)
        and acc.size >= count
        and _int32_array(table)
        and table.size == 1 << bits
    ):
        return False
    raw = np.frombuffer(payload, dtype=np.uint8)
    addresses = (acc.ctypes.data, raw.ctypes.data, raw.size)
    _kernels.lookup_accumulate(*addresses, count, bits, table.ctypes.data, first)
    return True


def pack_int32(values: np.ndarray, width: int) -> np.ndarray | None:
    """The low ``width`` (<= 16) bits of int32 ``values``, packed as ``bits.pack_bits`` does."""
    if not (available() and 1 <= width <= MAX_SUM_BITS and _int32_array(values)):
        return None
    out = np.empty(packed_nbytes(values.size, width), dtype=np.uint8)
    _kernels.pack_int32(values.ctypes.data, values.size, width, out.ctypes.data, out.size)
    return out


def _int32_array(a: np.ndarray) -> bool:
    return a.dtype == np.int32 and a.flags.c_contiguous
