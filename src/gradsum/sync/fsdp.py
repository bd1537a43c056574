"""FSDP2's gradient reduce-scatter through a gradsum codec, from the same Session as the DDP hook.

    session = Session(make_codec("thc", workers=world), AllReduceAggregator(), seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = shard_gradients(model, session)   # every FSDP unit's reduce-scatter
    ...
    loss.backward(); optimizer.step(); state.step += 1

``fully_shard`` hands each unit's reduce-scatter one flat gradient of ``world`` equal shards
(each parameter's dim-0 shard, zero-padded to equal size, in the unit's parameter order); rank r
keeps the average of shard r. With a homomorphic codec that is one codec round per shard, whose
partitions, rotations and random streams never leave their shard (``shard_keys``):

    every rank:  precondition + summarize all W shards   (error feedback per rank, unit, shard)
                 one MAX all-reduce of every summary
                 encode all W shards to integer lanes, each shard's padded to the longest
                 one SUM reduce-scatter of the lanes       (width checked against W workers)
    rank r:      decode shard r from its summed lanes

so rank r's output is, bit for bit, the reference round (``codecs.round.run_round``) of shard r
of every rank's gradient. Integer lanes go in the codec's sum dtype (THC: uint8 up to 8 workers),
so the reduce-scatter carries a quarter of fp32's bytes; a float-summing codec (``none``) sums
its float lanes, which is torch's reduce-scatter up to the order of additions.

Codecs that are not homomorphic (PowerSGD, top-k, ...) have no lanes a reduce-scatter could sum;
``shard_gradients`` refuses them (``NotHomomorphic``) instead of falling back to anything.

HSDP (``hsdp_replicas``): ``fully_shard`` over the shard dimension of a 2-D mesh, and the
replica all-reduce, which torch then leaves to ``set_all_reduce_hook``, is the same codec's
all-reduce round over the replica group (a Session of its own on that group, the same codec
object): each of the two collectives is compressed.

The round's step is the training step (``FSDPCodecState.step``, which the training loop
advances and a checkpoint saves beside the codec's state), so a resumed run draws the random
streams and keeps the error feedback of the run it continues.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..codecs import Payload
from ..codecs.base import DeviceChecks
from ..codecs.integers import check_workers, from_integers, sum_dtype, to_integers
from ..codecs.round import CodecRound, Prepared
from .session import Session

try:  # torch's base class for a custom reduce-scatter (its module is private in torch 2.13)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _TorchReduceScatter
except ImportError:  # pragma: no cover - older torch: FSDP2 only calls the two methods below
    _TorchReduceScatter = object


class NotHomomorphic(TypeError):
    """The codec's payloads cannot be summed by a reduce-scatter."""


def check_shardable(codec) -> None:
    """Refuse a codec whose payloads a reduce-scatter cannot sum: one that decodes and
    re-encodes at the aggregator, or one of several stages (PowerSGD)."""
    if not codec.aggregation.homomorphic or codec.stages != 1 or codec.lane_fields is None:
        raise NotHomomorphic(
            f"codec {codec.name!r} cannot compress FSDP2's reduce-scatter: a reduce-scatter "
            f"sums lanes, and {codec.name!r} is {codec.aggregation.value}"
            + (f" in {codec.stages} stages" if codec.stages != 1 else "")
            + "; use thc, thc-uniform, bfp or none (or DDP with this codec)"
        )


def shard_keys(key: Hashable, world: int) -> list[tuple[Hashable, int]]:
    """The round key of each of a unit's ``world`` shards: each shard is a round of its own."""
    return [(key, shard) for shard in range(world)]


@dataclass
class ShardedRound:
    """One rank's round of a reduce-scatter of ``world`` equal shards: the pure part, with no
    collective in it. ``summaries()`` go to a MAX over ranks, ``share`` takes the result,
    ``lanes()`` are this rank's integer (or float) lanes of every shard, each shard's padded to
    ``lanes_per_shard``, for a SUM reduce-scatter; ``decode(own)`` is this rank's shard's
    average from its summed lanes."""

    round: CodecRound
    flat: torch.Tensor
    world: int
    shard: int  # the shard this rank keeps (its rank in the reduce-scatter's group)
    worker: int  # this rank's worker id in the codec's random streams
    key: Hashable
    step: int
    prepared: list[Prepared] = field(default_factory=list)

    def __post_init__(self) -> None:
        total = self.flat.numel()
        if total % self.world:
            raise ValueError(f"a reduce-scatter input of {total} coordinates is not "
                             f"{self.world} equal shards")  # fmt: skip
        size = total // self.world
        self.size = size
        keys = shard_keys(self.key, self.world)
        self.prepared = [self._prepare(s, shard_key) for s, shard_key in enumerate(keys)]
        self.phases = None

    def _prepare(self, shard: int, key: Hashable) -> Prepared:
        flat = self.flat[shard * self.size : (shard + 1) * self.size]
        return self.round.prepare(flat, worker=self.worker, key=key, step=self.step)

    @property
    def codec(self):
        return self.round.codec

    def summaries(self) -> list[torch.Tensor]:
        return [s for prepared in self.prepared for s in prepared.summaries]

    def share(self, shared: Sequence[torch.Tensor]) -> None:
        offset = 0
        for prepared in self.prepared:
            count = len(prepared.bounds)
            prepared.share(shared[offset : offset + count])
            offset += count

    def lanes(self) -> tuple[torch.Tensor, int]:
        """Every shard's lanes, each padded to the longest shard's count, and that count."""
        codec = self.codec
        integer = codec.aggregation.integer_only
        if integer:
            check_workers(codec, self.world)  # before anything is summed
        self.phases = [prepared.sum_phase() for prepared in self.prepared]
        per_shard = []
        for phase in self.phases:
            payloads = phase.payloads()
            if integer:
                parts = [to_integers(codec, p).reshape(-1) for p in payloads]
            else:
                up, _ = codec.lane_fields
                parts = [p.fields[up].reshape(-1) for p in payloads]
            per_shard.append(parts)
        self._counts = [[part.numel() for part in parts] for parts in per_shard]
        longest = max(sum(counts) for counts in self._counts)
        dtype = sum_dtype(codec) if integer else torch.float32
        out = torch.zeros(self.world, longest, dtype=dtype, device=self.flat.device)
        for s, parts in enumerate(per_shard):
            if parts:
                joined = torch.cat([p.to(dtype) for p in parts])
                out[s, : joined.numel()] = joined
        return out.reshape(-1), longest

    def decode(self, own: torch.Tensor) -> torch.Tensor:
        """This rank's shard's average from its summed lanes (``own``, the reduce-scatter's
        output)."""
        if self.phases is None:
            raise RuntimeError("decode before the lanes were encoded")
        codec, phase = self.codec, self.phases[self.shard]
        _, down = codec.lane_fields
        offset = 0
        for i, count in enumerate(self._counts[self.shard]):
            sums = own[offset : offset + count]
            offset += count
            length = phase.pieces[i].length
            if codec.aggregation.integer_only:
                payload = from_integers(codec, sums, length, self.world)
            else:
                payload = Payload({down: sums}, length, self.world)
            phase.deliver(i, payload)
        return self.prepared[self.shard].result(phase)


def _op_name(op) -> str:
    for name in ("AVG", "SUM"):
        if op == getattr(dist.ReduceOp, name):
            return name
    raise ValueError(
        f"gradsum's FSDP2 reduce-scatter averages or sums; FSDP2 asked for {op!r} "
        "(set_gradient_divide_factor is not supported with a gradsum codec)"
    )


@dataclass
class FSDPCodecState:
    """What every unit's reduce-scatter shares: the Session, the training step (advanced by
    the loop, saved in checkpoints), and whether this step goes uncompressed (warm-up,
    retries: torch's own reduce-scatter, fp32)."""

    session: Session
    step: int = 0
    lossless: bool = False
    rounds: int = 0  # reduce-scatters run through the codec (what tests count)
    replica_rounds: int = 0  # HSDP replica all-reduces run through the codec
    _checks: DeviceChecks = field(default_factory=DeviceChecks, repr=False)

    @contextlib.contextmanager
    def uncompressed(self) -> Iterator[None]:
        self.lossless = True
        try:
            yield
        finally:
            self.lossless = False


class GradsumReduceScatter(_TorchReduceScatter):
    """One FSDP unit's reduce-scatter (``FSDPModule.set_custom_reduce_scatter``)."""

    def __init__(self, state: FSDPCodecState, name: str, sizes: Sequence[int] = ()):
        self.state, self.name = state, name
        self.sizes = tuple(int(s) for s in sizes)  # each parameter's padded shard, in order
        self._described: set[tuple[int, int]] = set()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False):  # fmt: skip
        state = self.state
        how = _op_name(op)
        if state.lossless:
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                              async_op=async_op)  # fmt: skip
        world = dist.get_world_size(group)
        average = reduce_scatter(state.session, input_tensor.reshape(-1), group,
                                 key=("fsdp", self.name), step=state.step,
                                 describe=self._describe)  # fmt: skip
        if how == "SUM":
            average = average * world
        output_tensor.copy_(average.view_as(output_tensor))
        state.rounds += 1
        return None

    def _describe(self, session: Session, key: Hashable, world: int, size: int) -> None:
        """Each shard's tensors for codecs that work per tensor (THC's scales): every parameter's
        padded shard, where they add up to the shard (FSDP2 leaves out a parameter without a
        gradient; that unit's shards then get one scale per partition)."""
        if (world, size) in self._described:
            return
        self._described.add((world, size))
        if sum(self.sizes) != size:
            return
        for shard_key in shard_keys(key, world):
            session.describe(shard_key, [(s,) for s in self.sizes])


def reduce_scatter(session: Session, flat: torch.Tensor, group: dist.ProcessGroup | None, *,
                   key: Hashable, step: int, describe=None) -> torch.Tensor:  # fmt: skip
    """This rank's shard of the average over ``group`` of ``flat`` (``world`` equal shards), as
    the Session's codec estimates it: one MAX all-reduce of the summaries, one SUM reduce-scatter
    of the lanes."""
    codec = session.codec
    check_shardable(codec)
    world, shard = dist.get_world_size(group), dist.get_rank(group)
    flat = flat.reshape(-1).to(torch.float32)
    if describe is not None:
        describe(session, key, world, flat.numel() // world)
    checks = DeviceChecks()
    with checks.deferring():
        sharded = ShardedRound(session.round, flat, world, shard, worker=dist.get_rank(),
                               key=key, step=step)  # fmt: skip
        if codec.needs_summary:
            summaries = sharded.summaries()
            joined = torch.cat([s.reshape(-1).to(torch.float32) for s in summaries])
            dist.all_reduce(joined, op=dist.ReduceOp.MAX, group=group)
            sharded.share(_split_like(joined, summaries))
        lanes, count = sharded.lanes()
        own = torch.empty(count, dtype=lanes.dtype, device=lanes.device)
        dist.reduce_scatter_tensor(own, lanes, op=dist.ReduceOp.SUM, group=group)
        average = sharded.decode(own)
    checks.raise_if_failed()
    return average


def _split_like(flat: torch.Tensor, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    pieces, offset = [], 0
    for part in parts:
        pieces.append(flat[offset : offset + part.numel()].view(part.shape).to(part.dtype))
        offset += part.numel()
    return pieces


def fsdp_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every FSDP2 unit of ``model`` (``fully_shard``ed modules that hold parameters of their
    own), by qualified name: the name keys the unit's codec state, the same in every run."""
    from torch.distributed.fsdp import FSDPModule

    units = []
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                units.append((name or "root", module))
    return units


def _padded_sizes(module) -> list[int]:
    group = module._get_fsdp_state()._fsdp_param_group
    return [int(p.padded_sharded_param_size.numel()) for p in group.fsdp_params]


def shard_gradients(model: torch.nn.Module, session: Session, *,
                    replica_group: dist.ProcessGroup | None = None) -> FSDPCodecState:  # fmt: skip
    """Install ``session``'s codec as the reduce-scatter of every FSDP2 unit of ``model``
    (call after ``fully_shard``); with ``replica_group`` (HSDP: ``fully_shard`` over the shard
    dimension), the replica all-reduce too (``hsdp_replicas``). Refuses a codec that is not
    homomorphic (``NotHomomorphic``)."""
    check_shardable(session.codec)
    units = fsdp_units(model)
    if not units:
        raise ValueError("no FSDP2 unit in the model: call fully_shard on it first")
    state = FSDPCodecState(session)
    for name, module in units:
        module.set_custom_reduce_scatter(GradsumReduceScatter(state, name, _padded_sizes(module)))
    if replica_group is not None:
        hsdp_replicas(model, state, replica_group)
    return state


def hsdp_replicas(model: torch.nn.Module, state: FSDPCodecState,
                  replica_group: dist.ProcessGroup) -> None:  # fmt: skip
    """The replica all-reduce of HSDP through the same codec, as every unit's all-reduce hook
    (``fully_shard`` on the shard group of the mesh; torch runs the hook after the unit's
    reduce-scatter, which averaged over the shard group: the hook averages over replicas)."""
    from .allreduce import AllReduceAggregator

    main = state.session
    replicas = Session(main.codec, AllReduceAggregator(replica_group), seed=main.seed,
                       partition_elements=main.partition_elements)  # fmt: skip
    for name, module in fsdp_units(model):
        module.set_all_reduce_hook(_ReplicaHook(state, replicas, name, replica_group))


class _ReplicaHook:
    def __init__(self, state: FSDPCodecState, session: Session, name: str, group):
        self.state, self.session, self.name, self.group = state, session, name, group

    def __call__(self, reduce_output: torch.Tensor) -> None:
        state = self.state
        if state.lossless:
            dist.all_reduce(reduce_output, group=self.group)
            reduce_output.div_(dist.get_world_size(self.group))
            return
        flat = reduce_output.reshape(-1).to(torch.float32)
        average = self.session.synchronize(flat, key=("hsdp", self.name), step=state.step)
        reduce_output.copy_(average.view_as(reduce_output))
        state.replica_rounds += 1
