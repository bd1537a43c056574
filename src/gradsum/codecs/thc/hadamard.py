"""Randomized Hadamard transform (RHT): O(d log d), any device; native kernels on the CPU.

RHT(x) = H D x / sqrt(B) applied to each block of B coordinates (B = the padded length for a full
rotation), with D a diagonal of random signs drawn from a seed that every worker shares. The
inverse is D H y / sqrt(B): H is symmetric and H H = B I.
"""

from __future__ import annotations

import functools
import math
import threading

import torch

from ..bits import pack_bits
from . import native


def next_power_of_two(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def padded_length(length: int, block: int | None) -> int:
    """Length after padding: a power of two (full rotation) or a multiple of the block."""
    if block is None:
        return next_power_of_two(length)
    if block < 1 or block & (block - 1):
        raise ValueError(f"rotation block size must be a power of two, got {block}")
    return max(block, -(-length // block) * block)


# On the CPU the first stages run as one matrix product with a dense Hadamard block along the
# contiguous axis (a BLAS kernel, ~2x faster than butterflies there); the rest are butterflies.
# Elsewhere every stage is a butterfly: a GPU matmul may run in TF32 (common in training
# scripts), which rounds the inputs to 10 bits, and the butterflies' order of additions is the
# one the fused Triton kernels (``triton_kernels.py``) reproduce bit for bit.
_DENSE_STAGES = 5


def hadamard_matrix(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Sylvester-ordered Hadamard matrix of a power-of-two size (unnormalised, ±1)."""
    matrix = torch.ones(1, 1, device=device)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix


_DENSE_CACHE: dict[tuple[int, torch.device], torch.Tensor] = {}


def _dense_block(size: int, device: torch.device) -> torch.Tensor:
    key = (size, device)
    if key not in _DENSE_CACHE:
        _DENSE_CACHE[key] = hadamard_matrix(size, device)
    return _DENSE_CACHE[key]


def fwht_(x: torch.Tensor, block: int, scratch: torch.Tensor | None = None,
          dense: bool | None = None) -> torch.Tensor:  # fmt: skip
    """Orthonormal Walsh-Hadamard transform of every block of ``block`` coordinates.

    ``x`` is 1-D float32 with a length that is a multiple of ``block`` (a power of two). The
    native kernel transforms ``x`` in place; torch's stages alternate between ``x`` and
    ``scratch`` so none allocates. Returns the one holding the result. ``dense``: the first
    stages as a matrix product (default: on the CPU only, see ``_DENSE_STAGES``).
    """
    if x.dim() != 1 or x.numel() % block or block & (block - 1):
        raise ValueError(f"fwht needs a 1-D tensor whose length is a multiple of {block}")
    if dense is None:
        dense = x.device.type == "cpu"
        if dense and native.fwht_(x, block, 1.0 / math.sqrt(block)):
            return x
    if scratch is None:
        scratch = torch.empty_like(x)
    src, dst = x, scratch
    half = 1
    width = min(block, 1 << _DENSE_STAGES) if dense else 1
    if width > 2:
        torch.matmul(src.view(-1, width), _dense_block(width, x.device), out=dst.view(-1, width))
        src, dst = dst, src
        half = width
    while half < block:
        pairs_src = src.view(-1, 2, half)
        pairs_dst = dst.view(-1, 2, half)
        torch.add(pairs_src[:, 0], pairs_src[:, 1], out=pairs_dst[:, 0])
        torch.sub(pairs_src[:, 0], pairs_src[:, 1], out=pairs_dst[:, 1])
        src, dst = dst, src
        half *= 2
    src.mul_(1.0 / math.sqrt(block))
    return src


def rotation_signs(length: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A ±1 float32 vector from a seed shared by all workers."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    signs = torch.randint(0, 2, (length,), generator=generator, dtype=torch.int8)
    return (signs.to(torch.float32) * 2.0 - 1.0).to(device)


class Rotation:
    """The RHT of one partition shape; reuses its sign vector and work buffers.

    Thread-safe: each thread gets its own work buffer, so shard streams that share a codec
    rotate at once without writing into each other's transforms."""

    def __init__(self, length: int, block: int | None, seed: int, device: torch.device | str):
        self.length = length
        self.padded = padded_length(length, block)
        self.block = self.padded if block is None else block
        self.signs = rotation_signs(self.padded, seed, device)
        self.device = torch.device(device)
        self._local = threading.local()

    @property
    def scratch(self) -> torch.Tensor:
        """This thread's work buffer (the native encode's transform runs in it, too)."""
        buffer = getattr(self._local, "scratch", None)
        if buffer is None:
            buffer = torch.empty(self.padded, dtype=torch.float32, device=self.device)
            self._local.scratch = buffer
        return buffer

    @functools.cached_property
    def sign_bits(self) -> torch.Tensor:
        """The signs as packed bits, set where negative: what the native kernels read."""
        return pack_bits((self.signs < 0).to(torch.uint8), 1, check=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (length ``self.length``) into a new tensor of the padded length."""
        buffer = torch.zeros(self.padded, dtype=torch.float32, device=x.device)
        torch.mul(x, self.signs[: self.length], out=buffer[: self.length])
        return self._own(fwht_(buffer, self.block, self.scratch), buffer)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Undo ``forward``; consumes ``y`` (padded length) and returns ``self.length`` values."""
        result = self._own(fwht_(y, self.block, self.scratch), y)
        return result[: self.length].mul_(self.signs[: self.length])

    def _own(self, result: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """Return the result in the caller's buffer so the scratch buffer stays ours."""
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result)
        return buffer
