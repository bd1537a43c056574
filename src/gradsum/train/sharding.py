"""A model sharded with FSDP2 in the training loop (``--shard fsdp2``).

The model is ``fully_shard``ed per transformer block for the gpt and per layer (each module
holding parameters of its own) for the others, then as a whole, with
``reshard_after_forward=False``: a step is one all-gather of the parameters (fp32) in forward and
one reduce-scatter of the gradients in backward, whichever method reduces them. The
reduce-scatter is gradsum's codec (``--aggregator allreduce --codec C``: ``sync/fsdp.py``, the
run's Session) or torch's own (``--aggregator ddp``: fp32, or with ``--ddp-hook bf16`` a bf16
``reduce_dtype``).

What the loop needs beyond a replicated model, all here: every rank evaluates (a sharded
forward is a collective), checkpoints hold the full model and optimizer state (gathered; loaded
back into this run's shards), a gradient's finiteness and the parameters' digest are the
whole model's, not this rank's shard's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .config import DDP, FSDP2

TORCH_REDUCE_DTYPES = {"allreduce": None, "bf16": "bfloat16"}  # --ddp-hook: reduce_dtype


def check_sharding(config) -> None:
    """Refuse what FSDP2 cannot run here, naming what would (ValueError)."""
    if config.aggregator == DDP:
        if config.ddp_hook not in TORCH_REDUCE_DTYPES:
            raise ValueError(
                f"--shard fsdp2 --aggregator ddp --ddp-hook {config.ddp_hook}: FSDP2's own "
                "reduce-scatter is fp32 (--ddp-hook allreduce) or bf16 (--ddp-hook bf16)"
            )
        return
    if config.aggregator != "allreduce":
        raise ValueError(
            f"--shard fsdp2 --aggregator {config.aggregator}: FSDP2's reduce-scatter runs over "
            "torch.distributed; use --aggregator allreduce (gradsum's codec) or ddp (torch's)"
        )
    from ..codecs import make_codec, parse_options
    from ..sync.fsdp import check_shardable

    codec = make_codec(config.codec, workers=1, **parse_options(config.codec_options))
    try:
        check_shardable(codec)
    except TypeError as error:
        raise ValueError(f"--shard fsdp2: {error}") from None


def sharded_method_name(config) -> str:
    if config.aggregator == DDP:
        return FSDP2 if config.ddp_hook == "allreduce" else f"{FSDP2}:{config.ddp_hook}"
    options = config.codec_options.replace(" ", "")
    return f"{FSDP2}:{config.codec}" + (f"({options})" if options else "")


def sharded_method_fields(name: str, tail: str) -> dict:
    """``fsdp2`` and ``fsdp2:bf16`` (torch's reduce-scatter), ``fsdp2:CODEC(...)`` (gradsum's)."""
    from ..cli import UsageError

    if tail in ("", "bf16"):
        return {"aggregator": DDP, "ddp_hook": tail or "allreduce", "shard": FSDP2}
    from .methods import codec_spec

    try:
        codec, options = codec_spec(tail)
        fields = {"aggregator": "allreduce", "codec": codec, "codec_options": options,
                  "shard": FSDP2}  # fmt: skip
        check_sharding(_Fields(fields))
    except ValueError as error:
        raise UsageError(f"--methods {name}: {error}") from None
    return fields


class _Fields:
    def __init__(self, fields: dict) -> None:
        self.__dict__.update({"ddp_hook": "allreduce", **fields})


def units(model):
    """The modules FSDP2 shards one by one: the gpt's blocks, else every module that holds
    parameters of its own (the model itself last, for what is left)."""
    from .models import GPT

    if isinstance(model, GPT):
        return list(model.blocks)
    return [m for m in model.modules()
            if m is not model and any(True for _ in m.parameters(recurse=False))]  # fmt: skip


def shard_model(model, config):
    """``fully_shard`` ``model`` in place over every worker (the default group's mesh)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    reduce = TORCH_REDUCE_DTYPES.get(config.ddp_hook) if config.aggregator == DDP else None
    policy = MixedPrecisionPolicy(reduce_dtype=getattr(torch, reduce) if reduce else None)
    for unit in units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    return model


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


class FSDPSync:
    """What the loop's ``Worker`` needs of a sync (``wait``, ``step``, ``uncompressed``,
    ``close``) for a sharded model: gradsum's reduce-scatter installed from the Session, or
    torch's own (``session`` None)."""

    def __init__(self, model, config, session) -> None:
        self.model, self.net = model, model
        self.state = None
        self._step = 0
        if session is not None:
            from ..sync.fsdp import shard_gradients

            self.state = shard_gradients(model, session)
            self.describe = f"FSDP2, reduce-scatter through gradsum's {session.codec.name}"
        else:
            dtype = TORCH_REDUCE_DTYPES[config.ddp_hook] or "float32"
            self.describe = f"FSDP2, torch's reduce-scatter in {dtype}"

    @property
    def step(self) -> int:
        return self._step if self.state is None else self.state.step

    @step.setter
    def step(self, value: int) -> None:
        if self.state is None:
            self._step = value
        else:
            self.state.step = value

    def wait(self) -> None:
        """FSDP2's backward has reduced every unit's gradient before it returns."""
        self.step += 1

    @contextlib.contextmanager
    def uncompressed(self) -> Iterator[None]:
        """Torch's fp32 reduce-scatter instead of the codec (warm-up, retried steps)."""
        with contextlib.nullcontext() if self.state is None else self.state.uncompressed():
            yield

    def close(self) -> None:
        pass


def gradients_finite(model) -> bool:
    """Whether every rank's shard of every gradient is finite (one MIN all-reduce, so all ranks
    decide alike)."""
    import torch
    import torch.distributed as dist

    from .guard import all_finite

    mine = all_finite(_local(p.grad) for p in model.parameters() if p.grad is not None)
    finite = torch.tensor([mine], dtype=torch.int32)
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    return bool(finite.item())


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def full_parameter(parameter):
    """The whole parameter (gathered from every rank's shard: a collective)."""
    return parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter


def full_states(model, optimizer) -> tuple[dict, dict]:
    """The whole model's and optimizer's state, gathered to the host (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return (get_model_state_dict(model, options=options),
            get_optimizer_state_dict(model, optimizer, options=options))  # fmt: skip


def load_full_states(model, optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Load whole states (``full_states``) into this run's shards."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)


def sharded_bytes_per_step(config, model) -> int:
    """What one worker contributes to a sharded step's collectives (as ``bench tta`` counts a
    DDP hook's: the payload, not a ring's forwarding): the parameters' all-gather in fp32, and
    the gradients' reduce-scatter in fp32, bf16, or the codec's summed lanes (THC: a byte per
    coordinate up to 8 workers, its sums' dtype) with its summaries."""
    import math

    import torch

    count = sum(p.numel() for p in model.parameters())
    gathered = 4 * count
    if config.aggregator == DDP:
        return gathered + (2 if config.ddp_hook == "bf16" else 4) * count
    from ..codecs import make_codec, parse_options
    from ..codecs.integers import sum_dtype, to_integers
    from ..codecs.round import run_round

    codec = make_codec(config.codec, workers=config.workers,
                       **parse_options(config.codec_options))  # fmt: skip
    codec.describe("model", [tuple(p.shape) for p in model.parameters()])
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(count, generator=generator) for _ in range(config.workers)]
    result = run_round(codec, inputs, key="model")
    integer = codec.aggregation.integer_only
    lanes = sum((to_integers(codec, payloads[0]).numel() if integer else payloads[0].length)
                for payloads, _, _ in result.pieces)  # fmt: skip
    width = sum_dtype(codec).itemsize if integer else 4
    summaries = sum(s.numel() for _, _, s in result.pieces if s is not None)
    return gathered + lanes * width + math.ceil(summaries * codec.summary_bits() / 8)
