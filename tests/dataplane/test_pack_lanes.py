"""The switch's result packer writes exactly the bytes of the codecs' packer."""

import numpy as np
import pytest
import torch

from gradsum.codecs.bits import pack_bits
from gradsum.dataplane.combiners import pack_lanes


@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 16, 20, 24, 31])
@pytest.mark.parametrize("count", [1, 7, 8, 13, 4099])
def test_pack_lanes_equals_pack_bits(width, count):
    values = np.random.default_rng(width * count).integers(0, 1 << width, count, dtype=np.int32)
    expected = pack_bits(torch.from_numpy(values), width, check=False).numpy()
    assert pack_lanes(values, width).tobytes() == expected.tobytes()
