"""Gradient codecs: worker encode -> aggregator op -> worker decode (see ``base``)."""

from .base import (
    AGGREGATOR,
    Aggregation,
    Codec,
    CodecContext,
    IntegerOp,
    NonFiniteGradientError,
    Payload,
    WidthOverflowError,
)
from .feedback import ErrorFeedback
from .registry import CODEC_NAMES, codec_options, make_codec, parse_options
from .round import RoundResult, nmse, run_round

__all__ = [
    "AGGREGATOR",
    "CODEC_NAMES",
    "Aggregation",
    "Codec",
    "CodecContext",
    "ErrorFeedback",
    "IntegerOp",
    "NonFiniteGradientError",
    "Payload",
    "RoundResult",
    "WidthOverflowError",
    "codec_options",
    "make_codec",
    "nmse",
    "parse_options",
    "run_round",
]
