"""Gradient codecs: worker encode -> aggregator op -> worker decode (see ``base``).

The names below load on first use (PEP 562), so that ``gradsum --help`` and command-line
parsing, which need only ``CODEC_NAMES``, do not import torch.
"""

from __future__ import annotations

from .._lazy import lazy_exports

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
    "split_spec": "registry",
    "RoundResult": "round",
    "nmse": "round",
    "run_round": "round",
}

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
