"""Bit packing of unsigned integers of any width from 1 to 32 bits.

Wire layout: element j occupies bits [j*w, (j+1)*w) of a little-endian bit stream (the least
significant bit of byte 0 is bit 0). Eight elements always fill exactly w bytes, so a packed
vector can be cut into packets at any multiple of 8 elements.
"""

from __future__ import annotations

import math

import torch

from .base import WidthOverflowError
from .lanes import packed_nbytes

_BYTE_ALIGNED = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


def bits_for(max_value: int) -> int:
    """Smallest width that holds every integer in [0, max_value]."""
    return max(1, int(max_value).bit_length())


def check_fits(values: torch.Tensor, width: int, what: str = "value") -> None:
    if values.numel() == 0:
        return
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= (1 << width):
        raise WidthOverflowError(
            f"{what} range [{low}, {high}] does not fit in {width} unsigned bits"
        )


def pack_bits(values: torch.Tensor, width: int, *, check: bool = True) -> torch.Tensor:
    """Pack non-negative integers (< 2**width) into a uint8 tensor."""
    _check_width(width)
    values = values.reshape(-1)
    if check:
        check_fits(values, width)
    count = values.numel()
    if count == 0:
        return torch.empty(0, dtype=torch.uint8, device=values.device)
    if width in _BYTE_ALIGNED:
        return values.to(_BYTE_ALIGNED[width]).contiguous().view(torch.uint8).clone()
    group = _group_size(width)
    padded = _pad_to(values, group)
    if 8 % width == 0:  # 1, 2, 4 bits: several elements per byte, combined in uint8
        lanes = padded.to(torch.uint8).view(-1, group)
        out = torch.zeros(lanes.shape[0], dtype=torch.uint8, device=values.device)
        for j in range(group):
            out |= lanes[:, j] << (j * width)
        return out[: packed_nbytes(count, width)]
    if group * width <= 56:  # a group of elements fits one int64 word
        lanes = padded.to(torch.int64).view(-1, group)
        word = torch.zeros(lanes.shape[0], dtype=torch.int64, device=values.device)
        for j in range(group):
            word |= lanes[:, j] << (j * width)
        nbytes = group * width // 8
        out = word.view(torch.uint8).view(-1, 8)[:, :nbytes].reshape(-1)
        return out[: packed_nbytes(count, width)]
    return _pack_by_bits(padded, width)[: packed_nbytes(count, width)]


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``count`` integers as int32 (int64 for width 32+)."""
    _check_width(width)
    expected = packed_nbytes(count, width)
    if packed.dtype != torch.uint8 or packed.numel() < expected:
        raise ValueError(
            f"need {expected} packed bytes of uint8 for {count} values of {width} bits, "
            f"got {packed.numel()} of {packed.dtype}"
        )
    packed = packed.reshape(-1)[:expected].contiguous()
    if count == 0:
        return torch.empty(0, dtype=torch.int32, device=packed.device)
    if width in _BYTE_ALIGNED:
        raw = packed.view(_BYTE_ALIGNED[width])
        if width == 8:
            return raw.to(torch.int32)
        mask = (1 << width) - 1
        return raw.to(torch.int64) & mask
    group = _group_size(width)
    group_bytes = group * width // 8
    padded = _pad_to(packed, group_bytes)
    if 8 % width == 0:
        mask = (1 << width) - 1
        lanes = [(padded >> (j * width)) & mask for j in range(group)]
        return torch.stack(lanes, dim=1).reshape(-1)[:count].to(torch.int32)
    if group * width <= 56:
        words = torch.zeros(
            padded.numel() // group_bytes, 8, dtype=torch.uint8, device=packed.device
        )
        words[:, :group_bytes] = padded.view(-1, group_bytes)
        word = words.view(torch.int64).reshape(-1)
        mask = (1 << width) - 1
        lanes = [(word >> (j * width)) & mask for j in range(group)]
        return torch.stack(lanes, dim=1).reshape(-1)[:count].to(torch.int32)
    return _unpack_by_bits(padded, width)[:count]


def _check_width(width: int) -> None:
    if not 1 <= width <= 32:
        raise ValueError(f"bit width must be in 1..32, got {width}")


def _group_size(width: int) -> int:
    """Elements per group that fills whole bytes: lcm(width, 8) / width."""
    return 8 // math.gcd(width, 8)


def _pad_to(values: torch.Tensor, multiple: int) -> torch.Tensor:
    remainder = values.numel() % multiple
    if remainder == 0:
        return values
    return torch.cat([values, values.new_zeros(multiple - remainder)])


def _bit_weights(device: torch.device) -> torch.Tensor:
    return (1 << torch.arange(8, device=device, dtype=torch.int64)).to(torch.uint8)


def _pack_by_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """General path: expand to single bits, then fold eight bits into each byte."""
    shifts = torch.arange(width, device=values.device, dtype=torch.int64)
    bits = ((values.to(torch.int64).unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1, 8)
    return (bits * _bit_weights(values.device)).sum(dim=1, dtype=torch.uint8)


def _unpack_by_bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = ((packed.unsqueeze(1) >> shifts) & 1).to(torch.int64).reshape(-1, width)
    weights = 1 << torch.arange(width, device=packed.device, dtype=torch.int64)
    return (bits * weights).sum(dim=1)
