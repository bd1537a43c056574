"""The run's Session on a worker: its codec built once, the aggregator it talks to, and the
combinations that cannot work refused."""

from __future__ import annotations

from ..codecs import Codec, make_codec, parse_options
from ..sync.aggregator import Aggregator
from ..sync.session import Session
from .config import AGGREGATOR_NAMES, DDP


class IncompatibleChoice(ValueError):
    """The codec cannot run on the chosen aggregator; the message says what would."""


def check_compatible(aggregator: str, codec: str, options: dict | None = None) -> None:
    """Refuse an aggregator the codec cannot run on, or options the codec does not have: the
    command line's check, before any worker starts."""
    if aggregator == DDP:  # torch's DDP hooks compress, not a gradsum codec (train/peers.py)
        return
    check_carries(aggregator, make_codec(codec, workers=1, **(options or {})))


def check_carries(aggregator: str, codec: Codec) -> None:
    """Refuse an aggregator that cannot carry ``codec``."""
    if aggregator not in AGGREGATOR_NAMES:
        raise IncompatibleChoice(
            f"unknown aggregator {aggregator!r}; choose one of {', '.join(AGGREGATOR_NAMES)}"
        )
    if aggregator == "switch" and not codec.aggregation.integer_only:
        name = codec.name
        raise IncompatibleChoice(
            f"codec {name!r} cannot run on the switch: a switch only adds integers, and "
            f"{name!r} is {codec.aggregation.value}; use bfp or thc (or thc-uniform) on the "
            "switch, or --aggregator ps / allreduce"
        )


def open_session(config, rank: int, world: int) -> Session:
    """This worker's Session of the run: the codec built from ``config`` (once: nothing below
    builds another), the aggregator, and the round's options. The caller closes
    ``session.aggregator``."""
    options = parse_options(config.codec_options)
    codec = make_codec(config.codec, workers=world, **options)
    aggregator = make_aggregator(config, rank, world, codec)
    try:
        return Session(codec, aggregator, options=options, seed=config.seed)
    except BaseException:
        aggregator.close()
        raise


def make_aggregator(config, rank: int, world: int, codec: Codec) -> Aggregator:
    """The aggregator ``config`` names, refusing one that cannot carry ``codec``."""
    check_carries(config.aggregator, codec)
    if config.aggregator == "allreduce":
        import torch.distributed as dist

        from ..sync.allreduce import AllReduceAggregator

        # an outer round in flight beside the inner steps' loss agreement: collectives from
        # two threads on one group could pair differently on each rank
        return AllReduceAggregator(group=dist.new_group() if _overlaps(config) else None)
    from ..sync.service import JobSettings, ServiceAggregator
    from ..sync.sharded import ShardedServiceAggregator

    if config.aggregator == "switch":  # a switch of several pipelines: one address each
        addresses = config.switch.split(",") if config.switch else [None]
    else:
        addresses = list(config.servers)
    if not all(addresses):
        flag = "--switch HOST:PORT" if config.aggregator == "switch" else "--servers HOST:PORT,..."
        raise IncompatibleChoice(f"--aggregator {config.aggregator} needs {flag}")
    settings = JobSettings(rank, world, mtu=config.mtu, window_bytes=config.window_bytes,
                           silence=config.liveness, timeout=config.timeout)  # fmt: skip
    if config.aggregator == "ps":  # shards addressed one by one: plans place parts on them
        return ShardedServiceAggregator(addresses, settings, standby=config.standby)
    return ServiceAggregator(config.aggregator, addresses, settings, standby=config.standby)


def _overlaps(config) -> bool:
    """Whether the run's outer rounds run while inner steps do (sync/local_steps.py)."""
    from ..sync.local_steps import parse_local_steps

    return bool(config.local_steps) and parse_local_steps(config.local_steps).overlap > 0
