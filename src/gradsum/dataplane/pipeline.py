"""A SUM round encoded and decoded part by part while its chunks stream (sans-IO).

Block floating point needs nothing global after its exponent round: each block of coordinates
encodes and decodes on its own. So the round need not encode the whole tensor before its first
chunk leaves, nor wait for the last result before decoding the first: ``PartwiseRound`` cuts the
lanes into parts (whole chunks and whole blocks), and the transport calls ``step`` between its
batches of packets — encode the next part and release its chunks into the window, or decode a
part whose chunks have all come back. The values are the whole tensor's, bit for bit: the same
kernels run on the same blocks.
"""

from __future__ import annotations

import math

import torch

from .transfer import Transfer


class PartwiseRound:
    def __init__(self, codec, x: torch.Tensor, shared: torch.Tensor, upstream: torch.Tensor,
                 result: torch.Tensor, out: torch.Tensor, lanes_per_chunk: int,
                 transfer: Transfer, min_part: int = 1 << 18):  # fmt: skip
        self.codec, self.x, self.shared = codec, x, shared
        self.upstream, self.result, self.out = upstream, result, out
        self.per_chunk, self.transfer = lanes_per_chunk, transfer
        self.lanes = x.numel()
        unit = math.lcm(lanes_per_chunk, codec.block_size)  # whole chunks and whole blocks
        self.part = unit * max(1, -(-min_part // unit))  # at least min_part lanes
        self.parts = -(-self.lanes // self.part)
        self.encoded = self.decoded = 0
        self.mixed = False  # chunks summed over different numbers of workers (a quorum)
        transfer.stream.ready = transfer.first  # nothing to send before the first part

    @property
    def pending(self) -> bool:
        """Work that can be done now."""
        return self.encoded < self.parts or self._decodable()

    def step(self, now: float) -> list[tuple[Transfer, int]]:
        """One part's work; returns the chunks released for sending."""
        if self.encoded < self.parts:
            start, stop = self._range(self.encoded)
            blocks = self._blocks(start, stop)
            self.codec.encode_into(self.x[start:stop], self.shared[blocks],
                                   self.upstream[start:stop])  # fmt: skip
            self.encoded += 1
            ready = self.transfer.first + -(-stop // self.per_chunk)
            return [(self.transfer, c) for c in self.transfer.release(ready, now)]
        if self._decodable():
            self._decode_part(self.decoded)
        return []

    def finish(self) -> bool:
        """Decode what is left once every chunk is in; False if a quorum mixed the counts (the
        caller decodes the whole round instead)."""
        while not self.mixed and self.decoded < self.parts and self._decodable():
            self._decode_part(self.decoded)
        return not self.mixed and self.decoded == self.parts

    def _decodable(self) -> bool:
        if self.mixed or self.decoded >= self.parts or self.decoded >= self.encoded:
            return False
        counts = self._counts(self.decoded)
        return bool(counts.min() > 0)

    def _decode_part(self, index: int) -> None:
        counts = self._counts(index)
        if counts.min() != counts.max():
            self.mixed = True
            return
        start, stop = self._range(index)
        self.codec.decode_into(self.result[start:stop], int(counts[0]),
                               self.shared[self._blocks(start, stop)],
                               self.out[start:stop])  # fmt: skip
        self.decoded += 1

    def _counts(self, index: int):
        start, stop = self._range(index)
        return self.transfer.contributors[start // self.per_chunk : -(-stop // self.per_chunk)]

    def _range(self, index: int) -> tuple[int, int]:
        return index * self.part, min(self.lanes, (index + 1) * self.part)

    def _blocks(self, start: int, stop: int) -> slice:
        size = self.codec.block_size
        return slice(start // size, -(-stop // size))
