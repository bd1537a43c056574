"""Gradient codecs: worker encode -> aggregator op -> worker decode (see ``base``).

The names below load on first use (PEP 562), so that ``gradsum --help`` and command-line
parsing, which need only ``CODEC_NAMES``, do not import torch.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "AGGREGATOR": "base",
    "Aggregation": "base",
    "Codec": "base",
    "CodecContext": "base",
    "IntegerOp": "base",
    "NonFiniteGradientError": "base",
    "Payload": "base",
    "WidthOverflowError": "base",
    "ErrorFeedback": "feedback",
    "CODEC_NAMES": "names",
    "codec_options": "registry",
    "make_codec": "registry",
    "parse_options": "registry",
    "RoundResult": "round",
    "nmse": "round",
    "run_round": "round",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
