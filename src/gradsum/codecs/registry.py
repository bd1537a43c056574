"""Codec names as users write them (``--codec thc``) and how to build each one."""

from __future__ import annotations

import inspect
import math

from ..spec import parse_options, signature_options, split_spec
from .base import Codec
from .bfp import BlockFloatingPoint
from .feedback import feedback_for
from .lowrank import PowerSGD
from .names import CODEC_NAMES, CODEC_OPTIONS, FEEDBACK_BOUNDS, check_codec
from .plain import FP16, NoCompression
from .qsgd import QSGD
from .sparse import DGC, TopK
from .terngrad import TernGrad
from .thc.codec import SCALES, THC, UniformTHC, UnrotatedUniformTHC

__all__ = ["adaptive", "check_codec", "codec_options", "make_codec", "parse_options", "split_spec"]

# Error feedback's default: on, off, or on unless the optimizer is adaptive. An unbiased codec
# (THC's stochastic rounding) needs no feedback to converge; what feedback adds is the previous
# step's error minus this step's, twice the variance of either. SGD sums its steps, where those
# differences cancel; Adam divides every coordinate by its running RMS, which the doubled noise
# inflates, so each step shrinks (docs/benchmarks.md, "Codec quality across models").
UNLESS_ADAPTIVE = "unless adaptive"
# optimizers that scale each coordinate by its own gradient history
ADAPTIVE_OPTIMIZERS = ("adam", "adamw", "adamax", "nadam", "radam", "adagrad", "adadelta",
                       "rmsprop", "adafactor", "lamb")  # fmt: skip

# name -> (class, error feedback by default)
_CODECS: dict[str, tuple[type[Codec], bool | str]] = {
    "none": (NoCompression, False),
    "fp16": (FP16, False),
    "bfp": (BlockFloatingPoint, False),
    "thc": (THC, UNLESS_ADAPTIVE),
    "thc-uniform": (UniformTHC, True),  # the authors' THC, as they run it
    "thc-uniform-unrotated": (UnrotatedUniformTHC, False),
    "topk": (TopK, True),
    "dgc": (DGC, False),  # DGC accumulates locally by itself
    "terngrad": (TernGrad, False),
    "qsgd": (QSGD, False),
    "powersgd": (PowerSGD, True),  # its own error feedback (an option)
}

if tuple(_CODECS) != CODEC_NAMES:  # names.py lists them for command lines without torch
    raise ImportError(f"codecs/names.py lists {CODEC_NAMES}, the registry has {tuple(_CODECS)}")


def _declared_options_drift() -> list[str]:
    """The codecs whose options in names.py are not their constructors' (names, defaults,
    types) or whose feedback bound differs: none, or the table is out of date."""
    drift = []
    for name, (cls, _) in _CODECS.items():
        own = signature_options(cls.__init__, skip=("self", "workers"))
        declared = CODEC_OPTIONS[name]
        same = list(own) == list(declared) and all(
            own[k].default == declared[k].default and own[k].types == declared[k].types
            for k in own
        )
        bound = None if cls.keeps_own_feedback else cls.feedback_bound
        if not same or FEEDBACK_BOUNDS.get(name, None) != bound or (
            (name in FEEDBACK_BOUNDS) == cls.keeps_own_feedback
        ):
            drift.append(name)
    if CODEC_OPTIONS["thc"]["scales"].words != SCALES:
        drift.append("thc")
    return drift


_DRIFT = _declared_options_drift()
if _DRIFT:
    raise ImportError(f"codecs/names.py's options differ from these codecs' own: {_DRIFT}")


def make_codec(name: str, workers: int = 1, error_feedback: bool | None = None,
               feedback_bound: float | None = None, optimizer: object = None,
               **options) -> Codec:  # fmt: skip
    """Build a codec by name, e.g. ``make_codec("thc", workers=4, bits=4, granularity=30)``.
    ``feedback_bound``: error feedback's memory added is at most that times the gradient's
    norm (``feedback.ErrorFeedback``); None: the codec's own (``Codec.feedback_bound``); inf:
    unbounded. ``optimizer``: the optimizer the averages feed (its name, ``"adamw"``, or the
    optimizer itself), which sets error feedback's default where a codec's depends on it
    (THC's: off under adaptive optimizers); None: as under SGD."""
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
    if error_feedback is not None:
        use_feedback = error_feedback
    elif feedback_default == UNLESS_ADAPTIVE:
        use_feedback = not adaptive(optimizer)
    else:
        use_feedback = feedback_default
    if feedback_bound is not None and (cls.keeps_own_feedback or not use_feedback):
        why = (
            "it keeps its own error feedback" if cls.keeps_own_feedback
            else "it runs without error feedback"
            + (" (off by default under an adaptive optimizer; error_feedback=true turns it on)"
               if feedback_default == UNLESS_ADAPTIVE else "")
        )  # fmt: skip
        raise ValueError(f"codec {name!r} takes no feedback_bound: {why}")
    if feedback_bound is None:
        feedback_bound = cls.feedback_bound
    elif feedback_bound == math.inf:
        feedback_bound = None
    if cls.keeps_own_feedback:
        options.setdefault("error_feedback", use_feedback)
        return cls(workers=workers, **options)
    codec = cls(workers=workers, **options)
    return feedback_for(codec, feedback_bound) if use_feedback else codec


def adaptive(optimizer: object) -> bool:
    """Whether ``optimizer`` (a name, an optimizer or its class; None: unknown, taken as SGD)
    scales each coordinate by its own gradient history, as Adam does."""
    if optimizer is None:
        return False
    if isinstance(optimizer, str):
        name = optimizer
    else:
        name = (optimizer if isinstance(optimizer, type) else type(optimizer)).__name__
    return name.lower() in ADAPTIVE_OPTIMIZERS


def codec_options(name: str) -> dict[str, object]:
    """A codec's tunable options and their defaults, error feedback's among them."""
    cls, feedback_default = _CODECS[name]
    parameters = inspect.signature(cls.__init__).parameters.values()
    options = {p.name: p.default for p in parameters if p.name not in ("self", "workers")}
    feedback = {"error_feedback": feedback_default}
    if not cls.keeps_own_feedback:
        feedback["feedback_bound"] = cls.feedback_bound
    return {**options, **feedback}
