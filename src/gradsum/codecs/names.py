"""The codec names users write (``--codec thc``) and their options, importable without torch:
a command line lists the names and checks a spec's options before anything heavy loads (a bad
option is refused in well under a second). ``registry`` builds each codec and checks, when it
loads, that these tables are the classes' own signatures."""

from __future__ import annotations

from ..spec import Option, check_options

CODEC_NAMES = ("none", "fp16", "bfp", "thc", "thc-uniform", "thc-uniform-unrotated", "topk",
               "dgc", "terngrad", "qsgd", "powersgd")

_BOOL, _INT, _FLOAT = frozenset({"bool"}), frozenset({"int"}), frozenset({"float"})
_MAYBE_BOOL, _MAYBE_INT = frozenset({"bool", "None"}), frozenset({"int", "None"})
_MAYBE_FLOAT = frozenset({"float", "None"})
_SERVER = {"server_feedback": Option(None, _MAYBE_BOOL)}

# Each codec's constructor options (defaults and types, in the constructor's order), then error
# feedback's: ``error_feedback`` for every codec, ``feedback_bound`` for those the generic wrapper
# serves, its default the codec's own bound.
CODEC_OPTIONS: dict[str, dict[str, Option]] = {
    "none": {},
    "fp16": {**_SERVER},
    "bfp": {"block_size": Option(256, _INT)},
    "thc": {
        "bits": Option(4, _INT), "granularity": Option(None, _MAYBE_INT),
        "p": Option(None, _MAYBE_FLOAT), "rotation_block": Option(None, _MAYBE_INT),
        "correlated": Option(False, _BOOL), "spread_clamp": Option(None, _MAYBE_BOOL),
        "scales": Option("tensor", frozenset({"str"}), ("tensor", "partition")),
    },
    "thc-uniform": {
        "bits": Option(4, _INT), "p": Option(0.0002, _FLOAT),
        "rotation_block": Option(None, _MAYBE_INT), "correlated": Option(False, _BOOL),
    },
    "thc-uniform-unrotated": {"bits": Option(4, _INT), "correlated": Option(False, _BOOL)},
    "topk": {"ratio": Option(0.1, _FLOAT), **_SERVER},
    "dgc": {
        "ratio": Option(0.1, _FLOAT), "momentum": Option(0.9, _FLOAT),
        "sample_ratio": Option(0.01, _FLOAT), **_SERVER,
    },
    "terngrad": {"clip": Option(2.5, _MAYBE_FLOAT), **_SERVER},
    "qsgd": {"levels": Option(7, _INT), "bucket_size": Option(512, _INT), **_SERVER},
    "powersgd": {
        "rank": Option(1, _INT), "min_compression_rate": Option(2.0, _FLOAT),
        "warm_start": Option(True, _BOOL), "error_feedback": Option(True, _BOOL),
        "floats": Option(False, _BOOL), "block_size": Option(256, _INT),
        "first_q": Option("partition", frozenset({"str"}), ("partition", "shape")),
    },
}  # fmt: skip
# the bound's default where the generic wrapper serves the codec (absent: it keeps its own)
FEEDBACK_BOUNDS: dict[str, float | None] = {
    "none": None, "fp16": None, "bfp": None, "thc": 1.0, "thc-uniform": 1.0,
    "thc-uniform-unrotated": None, "topk": None, "dgc": None, "terngrad": None, "qsgd": None,
}  # fmt: skip


def accepted_options(name: str) -> dict[str, Option]:
    """Every option a spec of codec ``name`` may give, error feedback's among them."""
    accepted = {**CODEC_OPTIONS[name], "error_feedback": Option(None, _BOOL)}
    if name in FEEDBACK_BOUNDS:
        accepted["feedback_bound"] = Option(FEEDBACK_BOUNDS[name], _MAYBE_FLOAT)
    return accepted


def check_codec(name: str, options: dict) -> dict:
    """A codec's name and options checked as a command line gives them, before anything is
    built: the name one of ``CODEC_NAMES``, each option one the codec has, each value of its
    type (ValueError naming what is wrong and listing what is valid). Returns the options with
    their values as the codec takes them."""
    if name not in CODEC_OPTIONS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    return check_options("codec", name, options, accepted_options(name))
