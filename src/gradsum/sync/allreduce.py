"""The all-reduce aggregator: torch.distributed collectives (Gloo on CPU, NCCL on GPU).

* integer-homomorphic codecs (thc, thc-uniform, bfp): one MAX all-reduce for the preliminary
  round, then one SUM all-reduce of the integers an aggregator would add (THC: table values, in
  uint8 while n*g <= 255) -- compressed all the way through the ring;
* ``none``: a float SUM all-reduce;
* codecs that are not homomorphic: an all-gather of every worker's serialized payloads; each
  worker decodes all of them and averages (nothing is re-encoded).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..codecs import Aggregation, Codec, CodecContext, Payload
from ..codecs.integers import from_integers, sum_dtype, to_integers
from .aggregator import Aggregator, split_like


class AllReduceAggregator(Aggregator):
    name = "allreduce"

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_initialized():
            raise RuntimeError(
                "the allreduce aggregator needs torch.distributed initialised "
                "(start workers with torchrun or `gradsum train`)"
            )
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group = group

    def max_reduce(self, summaries: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        present = [s.reshape(-1).to(torch.float32) for s in summaries if s is not None]
        if not present:
            return list(summaries)
        flat = torch.cat(present)
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
        return split_like(flat, summaries)

    def reduce(
        self,
        codec: Codec,
        payloads: Sequence[Payload],
        contexts: Sequence[CodecContext],
        shared: Sequence[torch.Tensor | None],
    ) -> list[torch.Tensor]:
        if codec.aggregation.integer_only:
            return self._reduce_integers(codec, payloads, contexts, shared)
        if codec.aggregation is Aggregation.FLOAT_SUM:
            return self._reduce_floats(payloads)
        return self._gather_and_decode(codec, payloads, contexts)

    def _reduce_integers(self, codec, payloads, contexts, shared) -> list[torch.Tensor]:
        integers = [to_integers(codec, p) for p in payloads]
        flat = torch.cat(integers).to(sum_dtype(codec))
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        sums = split_like(flat, integers)
        return [
            codec.decode(from_integers(codec, s, p.length, self.world_size), ctx, sh)
            for s, p, ctx, sh in zip(sums, payloads, contexts, shared, strict=True)
        ]

    def _reduce_floats(self, payloads) -> list[torch.Tensor]:
        values = [p.fields["values"] for p in payloads]
        flat = torch.cat(values)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        return [s.div_(self.world_size) for s in split_like(flat, values)]

    def _gather_and_decode(self, codec, payloads, contexts) -> list[torch.Tensor]:
        from ..dataplane.payload_wire import deserialize, serialize

        blobs = [serialize(p) for p in payloads]
        mine = torch.frombuffer(bytearray(_frame(blobs)), dtype=torch.uint8)
        everyone = self._all_gather_bytes(mine)
        averages = [torch.zeros(p.length) for p in payloads]
        for blob in everyone:
            for i, piece in enumerate(_unframe(blob, len(payloads))):
                theirs = deserialize(piece, payloads[i].length, 1)
                averages[i] += codec.reconstruct(theirs, contexts[i])
        return [a.div_(self.world_size) for a in averages]

    def _all_gather_bytes(self, mine: torch.Tensor) -> list[bytes]:
        size = torch.tensor([mine.numel()], dtype=torch.int64)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: mine.numel()] = mine
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=self.group)
        return [g[: int(s.item())].numpy().tobytes() for g, s in zip(gathered, sizes, strict=True)]


def _frame(blobs: Sequence[bytes]) -> bytes:
    """Length-prefixed concatenation (u32 little-endian sizes)."""
    return b"".join(len(b).to_bytes(4, "little") + b for b in blobs)


def _unframe(data: bytes, count: int) -> list[bytes]:
    pieces, offset = [], 0
    for _ in range(count):
        size = int.from_bytes(data[offset : offset + 4], "little")
        pieces.append(data[offset + 4 : offset + 4 + size])
        offset += 4 + size
    if offset != len(data):
        raise ValueError(f"gathered payload frame has {len(data) - offset} trailing bytes")
    return pieces
