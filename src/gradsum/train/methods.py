"""Names of training methods, as ``bench tta`` and ``bench train`` take them and as tables and
messages print them: torch DDP and its hooks (``ddp``, ``ddp:fp16``, ``ddp:bf16``,
``ddp:powersgdR``, train/peers.py) or gradsum's ``AGGREGATOR:CODEC``, optionally with the codec's
options in parentheses: ``switch:thc(correlated=true,bits=4)``, the codec written as ``--codec``
takes it (gradsum/spec.py), and with local steps after a ``+``:
``allreduce:thc+diloco(h=32)`` (``--local-steps``, sync/local_steps.py).
Light: the command line parses them before torch is imported."""

from __future__ import annotations

from .config import DDP, FSDP2


def method_name(config) -> str:
    """The name a run's method goes by in tables and messages: ``ddp``, ``ddp:fp16``,
    ``ddp:powersgd2``, or gradsum's ``AGGREGATOR:CODEC``; sharded: ``fsdp2``, ``fsdp2:bf16``,
    ``fsdp2:CODEC``."""
    if getattr(config, "shard", "none") == FSDP2:
        from .sharding import sharded_method_name

        return sharded_method_name(config)
    if config.aggregator != "ddp":
        options = config.codec_options.replace(" ", "")
        local = f"+{config.local_steps}" if config.local_steps else ""
        return f"{config.aggregator}:{config.codec}" + (f"({options})" if options else "") + local
    if config.ddp_hook == "allreduce":
        return "ddp"
    if config.ddp_hook == "powersgd":
        return f"ddp:powersgd{config.powersgd_rank}"
    return f"ddp:{config.ddp_hook}"


def compresses(config) -> bool:
    """Whether the method's gradients lose anything on the way: not fp32 DDP, nor gradsum's
    lossless codecs (``none``, and ``bfp``, whose int32 lanes keep what fp32 training sees)."""
    if config.aggregator == "ddp":
        return config.ddp_hook != "allreduce"
    return config.codec not in ("none", "bfp")


def parse_methods(text: str) -> list[tuple[str, dict]]:
    """``--methods``: each method's name and ``TrainConfig`` fields."""
    return [(name, method_fields(name)) for name in split_methods(text)]


def split_methods(text: str, flag: str = "--methods") -> list[str]:
    """``--methods`` (or another ``flag``'s list) split at commas outside parentheses, so a
    codec's or a scheduler's options may hold commas of their own:
    ``ddp,switch:thc(correlated=true,bits=4)``."""
    from ..cli import UsageError
    from ..spec import split_list

    try:
        return split_list(text, flag)
    except ValueError as error:
        raise UsageError(str(error)) from None


def codec_spec(text: str) -> tuple[str, str]:
    """A codec with its options, ``thc(correlated=true,bits=4)``: its name and its options'
    text (empty when it has none), both checked: the name one of the codecs, each option one it
    has, each value of the option's type (ValueError naming what is wrong and what is valid)."""
    from ..codecs.names import check_codec
    from ..spec import parse_options, split_spec

    name, options = split_spec(text)
    check_codec(name, parse_options(options))
    return name, options


def method_fields(name: str) -> dict:
    """The ``TrainConfig`` fields of a method name: ``ddp``, ``ddp:fp16``, ``ddp:bf16``,
    ``ddp:powersgdR``, or gradsum's ``AGGREGATOR:CODEC`` (``method_name`` is the inverse), as
    ``bench tta`` and ``bench train`` take them."""
    from ..cli import UsageError
    from ..spec import parse_options

    name, local = _local_part(name)
    head, _, tail = name.partition(":")
    if head == FSDP2:
        from .sharding import sharded_method_fields

        return sharded_method_fields(name, tail)
    if "(" in tail and (head == DDP or not tail.endswith(")")):
        raise UsageError(f"--methods {name}: options go as AGGREGATOR:CODEC(name=value,...)")
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
    try:  # the spec first, without torch: a bad option is refused at once
        codec, options = codec_spec(tail)
    except ValueError as error:
        raise UsageError(f"--methods {name}: {error}") from None
    from .aggregators import IncompatibleChoice, check_compatible

    try:
        check_compatible(head, codec, parse_options(options))
    except (IncompatibleChoice, ValueError) as error:
        raise UsageError(f"--methods {name}: {error}") from None
    return {"aggregator": head, "codec": codec, "codec_options": options, **local}


def _local_part(name: str) -> tuple[str, dict]:
    """A method's name without its ``+diloco(...)`` (local steps, sync/local_steps.py), and the
    field that sets."""
    from ..cli import UsageError

    depth = 0
    for i, char in enumerate(name):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "+" and depth == 0:
            head, spec = name[:i], name[i + 1 :]
            if head.startswith(DDP):
                raise UsageError(f"--methods {name}: local steps apply to gradsum's methods only")
            from ..sync.local_steps import parse_local_steps

            try:
                parse_local_steps(spec)
            except ValueError as error:
                raise UsageError(f"--methods {name}: {error}") from None
            return head, {"local_steps": spec.replace(" ", "")}
    return name, {}
