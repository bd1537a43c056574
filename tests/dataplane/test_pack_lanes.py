"""The switch's packer and unpacker (numpy) match the codecs' (torch) byte for byte."""

import numpy as np
import pytest
import torch

from gradsum.codecs.bits import pack_bits, unpack_bits
from gradsum.dataplane.combiners import pack_lanes, unpack_lanes


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 16, 20, 24, 31])
@pytest.mark.parametrize("count", [1, 7, 8, 13, 4099])
def test_pack_lanes_equals_pack_bits(width, count):
    values = np.random.default_rng(width * count).integers(0, 1 << width, count, dtype=np.int32)
    expected = pack_bits(torch.from_numpy(values), width, check=False).numpy()
    assert pack_lanes(values, width).tobytes() == expected.tobytes()


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 16, 20, 24, 31])
@pytest.mark.parametrize("count", [1, 7, 8, 13, 4099])
def test_unpack_lanes_equals_unpack_bits(width, count):
    values = np.random.default_rng(width + count).integers(0, 1 << width, count, dtype=np.int32)
    packed = pack_bits(torch.from_numpy(values), width, check=False)
    lanes = unpack_lanes(packed.numpy(), width, count)
    assert lanes.dtype == np.int32
    assert np.array_equal(lanes, unpack_bits(packed, width, count).numpy())
    assert np.array_equal(lanes, values)
