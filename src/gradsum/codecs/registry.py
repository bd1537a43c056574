"""Codec names as users write them (``--codec thc``) and how to build each one."""

from __future__ import annotations

import inspect
import math

from ..spec import parse_options, signature_options, split_spec
from .base import Codec
from .bfp import BlockFloatingPoint
from .feedback import feedback_for
from .lowrank import FIRST_Q, PowerSGD
from .names import CODEC_NAMES, CODEC_OPTIONS, FEEDBACK_BOUNDS, check_codec
from .plain import FP16, NoCompression
from .qsgd import QSGD
from .sparse import DGC, TopK
from .terngrad import TernGrad
from .thc.codec import SCALES, THC, UniformTHC, UnrotatedUniformTHC

__all__ = ["check_codec", "codec_options", "make_codec", "parse_options", "split_spec"]

# name -> (class, error feedback on by default)
_CODECS: dict[str, tuple[type[Codec], bool]] = {
    "none": (NoCompression, False),
    "fp16": (FP16, False),
    "bfp": (BlockFloatingPoint, False),
    # THC's rounding is unbiased: it needs no feedback to converge, and feedback's noise, the
    # previous step's error minus this step's, has twice the variance of either; it slowed
    # AdamW and destabilised SGD on a GPT (docs/benchmarks.md, "Codec quality across models")
    "thc": (THC, False),
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
    if CODEC_OPTIONS["powersgd"]["first_q"].words != FIRST_Q:
        drift.append("powersgd")
    return drift


_DRIFT = _declared_options_drift()
if _DRIFT:
    raise ImportError(f"codecs/names.py's options differ from these codecs' own: {_DRIFT}")


def make_codec(name: str, workers: int | None = None, error_feedback: bool | None = None,
               feedback_bound: float | None = None, **options) -> Codec:  # fmt: skip
    """Build a codec by name, e.g. ``make_codec("thc", workers=4, bits=4, granularity=30)``.
    ``feedback_bound``: error feedback's memory added is at most that times the gradient's
    norm (``feedback.ErrorFeedback``); None: the codec's own (``Codec.feedback_bound``); inf:
    unbounded. ``workers``: how many sum the codec's lanes; None: the default process group's
    size where one is initialized, else 1."""
    if workers is None:
        workers = _process_group_size()
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
        why = (
            "it keeps its own error feedback" if cls.keeps_own_feedback
            else "it runs without error feedback (error_feedback=true turns it on)"
        )
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


def codec_options(name: str) -> dict[str, object]:
    """A codec's tunable options and their defaults, error feedback's among them."""
    cls, feedback_default = _CODECS[name]
    parameters = inspect.signature(cls.__init__).parameters.values()
    options = {p.name: p.default for p in parameters if p.name not in ("self", "workers")}
    feedback = {"error_feedback": feedback_default}
    if not cls.keeps_own_feedback:
        feedback["feedback_bound"] = cls.feedback_bound
    return {**options, **feedback}


def _process_group_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
