"""Parse and print the link parameters a user gives: rates, durations and loss.

Pure functions. Rates are bits per second (``100mbit``, ``1gbit``, ``10gbit``, as in ``tc``);
durations are seconds (``5ms``, ``200us``, ``0``); loss is a fraction (``1%`` → 0.01).
"""

from __future__ import annotations

import re

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"
_RATE_RE = re.compile(_NUMBER + r"\s*([a-z]*)")
_DURATION_RE = re.compile(_NUMBER + r"\s*(us|ms|s)?")
_LOSS_RE = re.compile(_NUMBER + r"\s*%")


def parse_rate(text: str) -> int:
    """``"100mbit"`` → 100_000_000 bits per second. Raises ValueError naming the text."""
    match = _RATE_RE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in _RATE_UNITS:
        hint = " (tc's 'bps' means bytes/s; write bit rates)" if "bps" in text.lower() else ""
        raise ValueError(f"not a link rate: {text!r}; use e.g. 100mbit, 1gbit, 10gbit{hint}")
    bits = round(float(match.group(1)) * _RATE_UNITS[match.group(2)])
    if bits < 8_000:
        raise ValueError(f"link rate {text!r} is below 8kbit, too slow to carry a packet")
    return bits


def parse_duration(text: str) -> float:
    """``"5ms"`` → 0.005 seconds; a bare ``0`` is allowed. Raises ValueError naming the text."""
    match = _DURATION_RE.fullmatch(text.strip().lower())
    if match is None or (match.group(2) is None and float(match.group(1)) != 0):
        raise ValueError(f"not a duration: {text!r}; use e.g. 0, 200us, 5ms, 1s")
    return float(match.group(1)) * _DURATION_UNITS[match.group(2) or "s"]


def parse_loss(text: str) -> float:
    """``"1%"`` → 0.01; a bare ``0`` is allowed. Raises ValueError naming the text."""
    text = text.strip()
    if text in ("0", "0.0"):
        return 0.0
    match = _LOSS_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"not a loss rate: {text!r}; use a percentage, e.g. 0.1%, 1%")
    fraction = float(match.group(1)) / 100
    if fraction >= 1:
        raise ValueError(f"loss rate {text!r} must be below 100%")
    return fraction


def format_rate(bits_per_s: int) -> str:
    """Shortest exact tc spelling: 10**9 → ``"1gbit"``, 1_500_000 → ``"1500kbit"``."""
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        scale = _RATE_UNITS[unit]
        if bits_per_s % scale == 0:
            return f"{bits_per_s // scale}{unit}"
    return f"{bits_per_s}bit"


def format_duration(seconds: float) -> str:
    """Whole microseconds, tc's finest unit: 0.005 → ``"5000us"``."""
    return f"{round(seconds * 1e6)}us"


def format_loss(fraction: float) -> str:
    """0.01 → ``"1%"``; netem takes percentages."""
    return f"{fraction * 100:.6g}%"
