"""The all-reduce aggregator: torch.distributed collectives (Gloo on CPU, NCCL on GPU).

It is the round's ``Reducer`` over collectives:

* ``max``: one MAX all-reduce of every partition's summary;
* ``sum`` for integer-homomorphic codecs (thc, thc-uniform, bfp): one SUM all-reduce of the
  integers an aggregator would add (THC: table values, in uint8 while n*g <= 255, float16 integers
  while n*g < 2048, int32 beyond) --
  compressed all the way through the ring; for ``none``: a float SUM all-reduce, whose order of
  additions is the library's (so the last bit may differ from a sum in worker order), or with
  ``deterministic`` a sum in worker order, exactly what a parameter server and the reference
  compute (an all-to-all, each worker adding its share in worker order, and an all-gather: the
  ring's bytes, but not the library's pipelined ring, so it is an option and not the default);
* ``sum`` for codecs that are not homomorphic: an all-gather of every worker's serialized
  payloads, which each worker combines with ``codec.aggregate`` exactly as a parameter server
  would (decode, sum, re-encode, with the aggregator's randomness), so every aggregator gives
  the same average.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..codecs import Aggregation, Codec, Payload
from ..codecs.integers import check_workers, from_integers, sum_dtype, to_integers
from ..codecs.round import SumPhase
from .aggregator import Aggregator


class AllReduceAggregator(Aggregator):
    name = "allreduce"

    def __init__(self, group: dist.ProcessGroup | None = None, deterministic: bool | None = None):
        """``deterministic``: fp32 sums in worker order (see the module docstring); by default
        what ``torch.use_deterministic_algorithms`` asks for."""
        if not dist.is_initialized():
            raise RuntimeError(
                "the allreduce aggregator needs torch.distributed initialised "
                "(start workers with torchrun or `gradsum train`)"
            )
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group = group
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        self.deterministic = deterministic

    def reducer(self, codec: Codec) -> AllReduceAggregator:
        return self

    def max(self, summaries: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        flat = torch.cat([s.reshape(-1).to(torch.float32) for s in summaries])
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
        return _split_like(flat, summaries)

    def sum(self, phase: SumPhase) -> None:
        codec = phase.codec
        if codec.aggregation.integer_only:
            self._sum_integers(phase)
        elif codec.aggregation is Aggregation.FLOAT_SUM:
            self._sum_floats(phase)
        else:
            self._gather_and_aggregate(phase)

    def _sum_integers(self, phase: SumPhase) -> None:
        codec = phase.codec
        check_workers(codec, self.world_size)  # before anything is summed
        payloads = phase.payloads()
        integers = [to_integers(codec, p) for p in payloads]
        flat = torch.cat(integers).to(sum_dtype(codec))
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        for i, (sums, payload) in enumerate(zip(_split_like(flat, integers), payloads,
                                                strict=True)):  # fmt: skip
            phase.deliver(i, from_integers(codec, sums, payload.length, self.world_size))

    def _sum_floats(self, phase: SumPhase) -> None:
        up, down = phase.codec.lane_fields
        payloads = phase.payloads()
        values = [p.fields[up] for p in payloads]
        flat = torch.cat(values)
        if self.deterministic:
            flat = self._sum_in_worker_order(flat)
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        for i, (sums, payload) in enumerate(zip(_split_like(flat, values), payloads,
                                                strict=True)):  # fmt: skip
            phase.deliver(i, Payload({down: sums}, payload.length, self.world_size))

    def _sum_in_worker_order(self, flat: torch.Tensor) -> torch.Tensor:
        """x_0 + x_1 + ... + x_{n-1}, added in that order for every coordinate: worker w sums
        the w-th share of everyone's values, then everyone gathers the shares."""
        world, count = self.world_size, flat.numel()
        share = -(-count // world)
        padded = torch.zeros(share * world, dtype=flat.dtype, device=flat.device)
        padded[:count] = flat
        received = torch.empty_like(padded)
        dist.all_to_all_single(received, padded, group=self.group)
        parts = received.view(world, share)
        total = parts[0].clone()
        for w in range(1, world):
            total += parts[w]
        gathered = torch.empty_like(padded)
        dist.all_gather_single(gathered, total, group=self.group)
        return gathered[:count]

    def _gather_and_aggregate(self, phase: SumPhase) -> None:
        from ..dataplane.payload_wire import deserialize, serialize

        payloads = phase.payloads()
        blobs = [serialize(p) for p in payloads]
        mine = torch.frombuffer(bytearray(_frame(blobs)), dtype=torch.uint8)
        everyone = [_unframe(blob, len(blobs)) for blob in self._all_gather_bytes(mine)]
        for i, payload in enumerate(payloads):
            theirs = [deserialize(pieces[i], payload.length, 1) for pieces in everyone]
            phase.deliver(i, phase.codec.aggregate(theirs, phase.aggregator_context(i)))

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


def _split_like(flat: torch.Tensor, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Cut ``flat`` into pieces shaped like ``parts``."""
    pieces, offset = [], 0
    for part in parts:
        pieces.append(flat[offset : offset + part.numel()].view(part.shape))
        offset += part.numel()
    return pieces


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
