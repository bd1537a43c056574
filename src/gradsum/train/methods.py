"""Names of training methods, as ``bench tta`` and ``bench train`` take them and as tables and
messages print them: torch DDP and its hooks (``ddp``, ``ddp:fp16``, ``ddp:bf16``,
``ddp:powersgdR``, train/peers.py) or gradsum's ``AGGREGATOR:CODEC``. Light: the command line
parses them before torch is imported."""

from __future__ import annotations

from .config import DDP


def method_name(config) -> str:
    """The name a run's method goes by in tables and messages: ``ddp``, ``ddp:fp16``,
    ``ddp:powersgd2``, or gradsum's ``AGGREGATOR:CODEC``."""
    if config.aggregator != "ddp":
        return f"{config.aggregator}:{config.codec}"
    if config.ddp_hook == "allreduce":
        return "ddp"
    if config.ddp_hook == "powersgd":
        return f"ddp:powersgd{config.powersgd_rank}"
    return f"ddp:{config.ddp_hook}"


def method_fields(name: str) -> dict:
    """The ``TrainConfig`` fields of a method name: ``ddp``, ``ddp:fp16``, ``ddp:bf16``,
    ``ddp:powersgdR``, or gradsum's ``AGGREGATOR:CODEC`` (``method_name`` is the inverse), as
    ``bench tta`` and ``bench train`` take them."""
    from ..cli import UsageError
    from .aggregators import IncompatibleChoice, check_compatible

    head, _, tail = name.partition(":")
    if head == DDP:
        if tail in ("", "allreduce"):
            return {"aggregator": DDP, "ddp_hook": "allreduce"}
        if tail in ("fp16", "bf16"):
            return {"aggregator": DDP, "ddp_hook": tail}
        rank = tail.removeprefix("powersgd")
        if tail.startswith("powersgd") and rank.isdigit() and int(rank) > 0:
            return {"aggregator": DDP, "ddp_hook": "powersgd", "powersgd_rank": int(rank)}
        raise UsageError(f"--methods {name}: DDP's hooks are ddp, ddp:fp16, ddp:bf16, "
                         "ddp:powersgdR (R the rank)")  # fmt: skip
    if not tail:
        raise UsageError(f"--methods: {name!r} is not AGGREGATOR:CODEC nor a ddp method")
    try:
        check_compatible(head, tail)
    except (IncompatibleChoice, ValueError) as error:
        raise UsageError(f"--methods {name}: {error}") from None
    return {"aggregator": head, "codec": tail}
