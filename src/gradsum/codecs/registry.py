"""Codec names as users write them (``--codec thc``) and how to build each one."""

from __future__ import annotations

import inspect
import math

from ..spec import Option, check_options, parse_options, signature_options, split_spec
from .base import Codec
from .bfp import BlockFloatingPoint
from .feedback import feedback_for
from .lowrank import PowerSGD
from .names import CODEC_NAMES
from .plain import FP16, NoCompression
from .qsgd import QSGD
from .sparse import DGC, TopK
from .terngrad import TernGrad
from .thc.codec import THC, UniformTHC, UnrotatedUniformTHC

__all__ = ["check_codec", "codec_options", "make_codec", "parse_options", "split_spec"]

# name -> (class, error feedback on by default)
_CODECS: dict[str, tuple[type[Codec], bool]] = {
    "none": (NoCompression, False),
    "fp16": (FP16, False),
    "bfp": (BlockFloatingPoint, False),
    "thc": (THC, True),
    "thc-uniform": (UniformTHC, True),  # error feedback as THC's
    "thc-uniform-unrotated": (UnrotatedUniformTHC, False),
    "topk": (TopK, True),
    "dgc": (DGC, False),  # DGC accumulates locally by itself
    "terngrad": (TernGrad, False),
    "qsgd": (QSGD, False),
    "powersgd": (PowerSGD, True),  # its own error feedback (an option)
}

if tuple(_CODECS) != CODEC_NAMES:  # names.py lists them for command lines without torch
    raise ImportError(f"codecs/names.py lists {CODEC_NAMES}, the registry has {tuple(_CODECS)}")


def make_codec(name: str, workers: int = 1, error_feedback: bool | None = None,
               feedback_bound: float | None = None, **options) -> Codec:  # fmt: skip
    """Build a codec by name, e.g. ``make_codec("thc", workers=4, bits=4, granularity=30)``.
    ``feedback_bound``: error feedback's memory added is at most that times the gradient's
    norm (``feedback.ErrorFeedback``); None: the codec's own (``Codec.feedback_bound``); inf:
    unbounded."""
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    cls, feedback_default = _CODECS[name]
    if "error_feedback" in options:  # an option like the others on command lines
        error_feedback = options.pop("error_feedback")
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise ValueError(f"codec option error_feedback is true or false, got {error_feedback!r}")
    accepted = codec_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"codec {name!r} has no option {', '.join(unknown)}; "
            f"its options are {', '.join(accepted) or '(none)'}"
        )
    use_feedback = feedback_default if error_feedback is None else error_feedback
    if feedback_bound is not None and (cls.keeps_own_feedback or not use_feedback):
        why = "it keeps its own" if cls.keeps_own_feedback else "it runs without"
        raise ValueError(f"codec {name!r} takes no feedback_bound: {why} error feedback")
    if feedback_bound is None:
        feedback_bound = cls.feedback_bound
    elif feedback_bound == math.inf:
        feedback_bound = None
    if cls.keeps_own_feedback:
        options.setdefault("error_feedback", use_feedback)
        return cls(workers=workers, **options)
    codec = cls(workers=workers, **options)
    return feedback_for(codec, feedback_bound) if use_feedback else codec


def check_codec(name: str, options: dict) -> dict:
    """A codec's name and options checked as a command line gives them, before anything is
    built: the name one of ``CODEC_NAMES``, each option one the codec has, each value of its
    type (ValueError naming what is wrong and listing what is valid). Returns the options with
    their values as the codec takes them."""
    if name not in _CODECS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    cls, _ = _CODECS[name]
    accepted = signature_options(cls.__init__, skip=("self", "workers"))
    accepted["error_feedback"] = Option(None, frozenset({"bool"}))
    if not cls.keeps_own_feedback:
        accepted["feedback_bound"] = Option(cls.feedback_bound, frozenset({"float", "None"}))
    return check_options("codec", name, options, accepted)


def codec_options(name: str) -> dict[str, object]:
    """A codec's tunable options and their defaults, error feedback's among them."""
    cls, feedback_default = _CODECS[name]
    parameters = inspect.signature(cls.__init__).parameters.values()
    options = {p.name: p.default for p in parameters if p.name not in ("self", "workers")}
    feedback = {"error_feedback": feedback_default}
    if not cls.keeps_own_feedback:
        feedback["feedback_bound"] = cls.feedback_bound
    return {**options, **feedback}
