"""A switch slot's native kernels (lookup-and-add of packed indices, result packing) against the
numpy path they replace: the same int32 sums and the same result bytes."""

import numpy as np
import pytest
import torch

from gradsum.codecs.bits import pack_bits
from gradsum.codecs.thc import native
from gradsum.codecs.thc.codec import THC
from gradsum.dataplane.combiners import IntegerSumOp
from gradsum.dataplane.jobspec import IntegerSum

pytestmark = pytest.mark.skipif(not native.built(), reason="THC's C extension is not built")

THC_TABLE = THC(workers=4).table


@pytest.mark.parametrize(
    ("bits", "table", "out_bits"),
    [
        (4, THC_TABLE, 7),  # THC, 4 workers
        (4, THC_TABLE, 9),  # wider sums: 16-bit packing
        (4, None, 6),  # uniform THC
        (2, (0, 5, 9, 12), 6),
        (1, None, 3),
        (8, tuple(range(0, 512, 2)), 11),  # a table beyond 16 entries: the scalar loop
    ],
)
@pytest.mark.parametrize("elements", [1, 9, 4096 + 24, 74_800])
def test_slot_sums_and_result_bytes_match_numpy(monkeypatch, bits, table, out_bits, elements):
    spec = IntegerSum(bits, out_bits, False, table)
    rng = np.random.default_rng(bits * elements)
    payloads = [rng.integers(0, 256, -(-elements * bits // 8), dtype=np.uint8) for _ in range(3)]

    def slot_result(enabled: str):
        monkeypatch.setenv("GRADSUM_NATIVE", enabled)
        op = IntegerSumOp(spec, elements)
        acc = np.full(elements + 5, -7, dtype=np.int32)  # stale lanes of an earlier round
        op.first(acc, memoryview(payloads[0].tobytes()), elements, False)
        for payload in payloads[1:]:
            op.add(acc, memoryview(payload.tobytes()), elements, False)
        return acc[:elements].copy(), bytes(op.result(acc, elements))

    fast_sums, fast_bytes = slot_result("1")
    slow_sums, slow_bytes = slot_result("0")
    np.testing.assert_array_equal(fast_sums, slow_sums)
    assert fast_bytes == slow_bytes


@pytest.mark.parametrize("width", [1, 3, 7, 8, 9, 12, 16])
@pytest.mark.parametrize("count", [1, 31, 4096 + 3])
def test_native_packing_equals_the_codecs_packer(width, count):
    values = np.random.default_rng(width + count).integers(0, 1 << width, count, dtype=np.int32)
    expected = pack_bits(torch.from_numpy(values), width, check=False).numpy()
    assert native.pack_int32(values, width).tobytes() == expected.tobytes()


def test_kernels_decline_what_they_cannot_do(monkeypatch):
    values = np.zeros(8, dtype=np.int32)
    assert native.pack_int32(values, 17) is None
    assert native.pack_int32(values.astype(np.int64), 8) is None
    assert not native.lookup_accumulate(values, b"\0" * 8, 8, 3, np.zeros(8, np.int32), True)
    monkeypatch.setenv("GRADSUM_NATIVE", "0")
    assert native.pack_int32(values, 8) is None
