"""Choosing the aggregator a worker talks to, and refusing combinations that cannot work."""

from __future__ import annotations

from ..codecs import Codec, make_codec, parse_options
from ..sync.aggregator import Aggregator
from .config import AGGREGATOR_NAMES, DDP


class IncompatibleChoice(ValueError):
    """The codec cannot run on the chosen aggregator; the message says what would."""


def check_compatible(aggregator: str, codec: str, options: dict | None = None) -> None:
    """Refuse an aggregator the codec cannot run on, or options the codec does not have."""
    if aggregator == DDP:  # torch's DDP hooks compress, not a gradsum codec (train/peers.py)
        return
    if aggregator not in AGGREGATOR_NAMES:
        raise IncompatibleChoice(
            f"unknown aggregator {aggregator!r}; choose one of {', '.join(AGGREGATOR_NAMES)}"
        )
    built = make_codec(codec, workers=1, **(options or {}))
    if aggregator == "switch" and not built.aggregation.integer_only:
        raise IncompatibleChoice(
            f"codec {codec!r} cannot run on the switch: a switch only adds integers, and "
            f"{codec!r} is {built.aggregation.value}; use bfp or thc (or thc-uniform) on the "
            "switch, or --aggregator ps / allreduce"
        )


def make_aggregator(config, rank: int, world: int, codec: Codec) -> Aggregator:
    check_compatible(config.aggregator, config.codec, parse_options(config.codec_options))
    if config.aggregator == "allreduce":
        from ..sync.allreduce import AllReduceAggregator

        return AllReduceAggregator()
    from ..sync.service import JobSettings, ServiceAggregator
    from ..sync.sharded import ShardedServiceAggregator

    if config.aggregator == "switch":  # a switch of several pipelines: one address each
        addresses = config.switch.split(",") if config.switch else [None]
    else:
        addresses = list(config.servers)
    if not all(addresses):
        flag = "--switch HOST:PORT" if config.aggregator == "switch" else "--servers HOST:PORT,..."
        raise IncompatibleChoice(f"--aggregator {config.aggregator} needs {flag}")
    options = parse_options(config.codec_options)
    settings = JobSettings(codec, config.codec, options, rank, world, seed=config.seed,
                           mtu=config.mtu, window_bytes=config.window_bytes,
                           silence=config.liveness,
                           timeout=config.timeout)  # fmt: skip
    if config.aggregator == "ps":  # shards addressed one by one: plans place parts on them
        return ShardedServiceAggregator(addresses, settings, standby=config.standby)
    return ServiceAggregator(config.aggregator, addresses, settings, standby=config.standby)
