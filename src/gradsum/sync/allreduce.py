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
* ``sum`` for codecs that are not homomorphic: an all-gather of every worker's payloads as
  one uint8 buffer on the gradient's device, which each worker combines with
  ``codec.aggregate`` on the device exactly as a parameter server would (decode, sum,
  re-encode, with the aggregator's randomness), so every aggregator gives the same average.
  The payloads' sizes (known on the host: sparse codecs' differ between workers) go through a
  Gloo control group of the aggregator's own, so no device value is read to lay them out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..codecs import Aggregation, Payload
from ..codecs.integers import check_workers, from_integers, sum_dtype, to_integers
from ..codecs.round import SumPhase
from ..dataplane.codec_wire import WireFormat
from .aggregator import Aggregator, Channel


def _all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    """Every rank's ``tensor`` into ``output``: torch's ``all_gather_single`` where it has it,
    else the older name of the same collective (``pyproject`` admits torch >= 2.1; the
    GPU machines' images ship torch builds without the new name)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


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
        self.control = control_group(group)
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        self.deterministic = deterministic

    def connect(self, wire: WireFormat) -> Channel:
        """Every wire format goes through the same collectives: this aggregator is the reducer."""
        return Channel([self])

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
        _all_gather_single(gathered, total, group=self.group)
        return gathered[:count]

    def _gather_and_aggregate(self, phase: SumPhase) -> None:
        payloads = phase.payloads()
        device = phase.out.device
        mine = PayloadBytes.of(payloads, device)
        sizes = self._all_gather_sizes(mine.sizes)
        gathered = self._all_gather_bytes(mine.data, [PayloadBytes.total(s) for s in sizes])
        everyone = [mine.like(data, s) for data, s in zip(gathered, sizes, strict=True)]
        for i in range(len(payloads)):
            theirs = [pieces[i] for pieces in everyone]
            phase.deliver(i, phase.codec.aggregate(theirs, phase.aggregator_context(i)))

    def _all_gather_sizes(self, mine: list[int]) -> list[list[int]]:
        """Every worker's byte sizes, through the Gloo control group (host integers)."""
        size = torch.tensor(mine, dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.control)
        return [s.tolist() for s in sizes]

    def _all_gather_bytes(self, mine: torch.Tensor, totals: list[int]) -> list[torch.Tensor]:
        """Every worker's bytes on this worker's device, padded to the longest for the
        collective and cut back to each worker's own length."""
        padded = torch.zeros(max(totals), dtype=torch.uint8, device=mine.device)
        padded[: mine.numel()] = mine
        gathered = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded, group=self.group)
        return [g[:total] for g, total in zip(gathered, totals, strict=True)]


def control_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A Gloo group over ``group``'s ranks for host values (sizes, plans, checks): NCCL moves
    device tensors only, and a host value sent through it would cost a copy each way. The same
    group where it already is Gloo. Every rank must call this at once (it may create a group)."""
    if "gloo" in str(dist.get_backend(group)):  # gloo, or "cuda:nccl,cpu:gloo"
        return group
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo")


@dataclass
class PayloadBytes:
    """A worker's payloads of one round as one uint8 buffer on its device, and back.

    Every worker's payloads have the same fields and meta names in the same order (one codec),
    so only the byte size of each field differs (a sparse codec's selected coordinates): those
    sizes travel apart, as host integers. Meta values (scalars like TernGrad's scale) travel as
    float64 and come back as 0-d device tensors. Each part starts on a multiple of 8 bytes, so
    every field is a view of the buffer in its own dtype."""

    template: list[Payload]
    sizes: list[int]
    data: torch.Tensor

    @classmethod
    def of(cls, payloads: Sequence[Payload], device: torch.device) -> PayloadBytes:
        parts, sizes = [], []

        def add(raw: torch.Tensor) -> None:
            parts.append(raw.to(device))
            sizes.append(raw.numel())
            if raw.numel() % 8:
                parts.append(torch.zeros(8 - raw.numel() % 8, dtype=torch.uint8, device=device))

        for payload in payloads:
            for tensor in payload.fields.values():
                add(tensor.detach().reshape(-1).contiguous().view(torch.uint8))
            if payload.meta:
                values = [torch.as_tensor(v, dtype=torch.float64, device=device).reshape(1)
                          for v in payload.meta.values()]  # fmt: skip
                add(torch.cat(values).view(torch.uint8))
        data = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
        return cls(list(payloads), sizes, data)

    @staticmethod
    def total(sizes: Sequence[int]) -> int:
        """The buffer's bytes for parts of these sizes."""
        return sum(-(-size // 8) * 8 for size in sizes)

    def like(self, data: torch.Tensor, sizes: list[int]) -> list[Payload]:
        """Another worker's payloads from its bytes and sizes (one contributor each)."""
        out, offset = [], 0
        parts = iter(sizes)

        def take(dtype: torch.dtype) -> torch.Tensor:
            nonlocal offset
            size = next(parts)
            view = data[offset : offset + size].view(dtype)
            offset += -(-size // 8) * 8
            return view

        for payload in self.template:
            fields = {name: take(tensor.dtype) for name, tensor in payload.fields.items()}
            meta = {}
            if payload.meta:
                meta = dict(zip(payload.meta, take(torch.float64).unbind(), strict=True))
            out.append(Payload(fields, payload.length, 1, meta))
        return out


def _split_like(flat: torch.Tensor, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Cut ``flat`` into pieces shaped like ``parts``."""
    pieces, offset = [], 0
    for part in parts:
        pieces.append(flat[offset : offset + part.numel()].view(part.shape))
        offset += part.numel()
    return pieces
