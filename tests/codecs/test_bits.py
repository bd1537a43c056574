import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsum.codecs import WidthOverflowError
from gradsum.codecs.bits import bits_for, pack_bits, packed_nbytes, unpack_bits


@settings(max_examples=150, deadline=None)
@given(width=st.integers(1, 32), count=st.integers(0, 300), seed=st.integers(0, 2**31))
def test_pack_unpack_roundtrip(width, count, seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 1 << min(width, 62), (count,), generator=generator, dtype=torch.int64)
    values %= 1 << width
    packed = pack_bits(values, width)
    assert packed.dtype == torch.uint8
    assert packed.numel() == packed_nbytes(count, width)
    assert torch.equal(unpack_bits(packed, width, count).to(torch.int64), values)


@pytest.mark.parametrize("width", [1, 2, 3, 4, 7, 9, 12, 16])
def test_layout_is_little_endian_bit_stream(width):
    values = torch.tensor([(5 * j + 1) % (1 << width) for j in range(16)])
    packed = pack_bits(values, width)
    stream = "".join(format(byte, "08b")[::-1] for byte in packed.tolist())
    for j, value in enumerate(values.tolist()):
        assert int(stream[j * width : (j + 1) * width][::-1], 2) == value


def test_eight_elements_fill_whole_bytes_so_packets_can_be_cut():
    values = torch.arange(64) % 128
    whole = pack_bits(values, 7)
    assert torch.equal(whole[: 7 * 3], pack_bits(values[:24], 7))


def test_value_too_wide_is_an_error_before_packing():
    with pytest.raises(WidthOverflowError, match="does not fit in 7"):
        pack_bits(torch.tensor([0, 128]), 7)
    with pytest.raises(WidthOverflowError):
        pack_bits(torch.tensor([-1]), 4)


def test_bits_for():
    assert [bits_for(v) for v in (0, 1, 2, 120, 240, 255, 256, 960)] == [1, 1, 2, 7, 8, 8, 9, 10]


def test_unpack_rejects_short_input():
    with pytest.raises(ValueError, match="need 4 packed bytes"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 4, 8)
