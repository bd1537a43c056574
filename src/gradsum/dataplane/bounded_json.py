"""JSON from the network, bounded: size, nesting depth, integer and string length, finite numbers
and strings that are valid Unicode.

Python's ``json`` parses what it is given: 1,000 nested brackets raise ``RecursionError``, a
4,301-digit integer ``ValueError`` (after the interpreter's own limit), ``NaN`` and lone UTF-16
surrogates (``"\\ud800"``) come back as values that break whatever encodes them later. A control
message is small and flat, so anything beyond these limits is refused before a value exists.
"""

from __future__ import annotations

import json
import math
import re

MAX_BYTES = 65507  # one datagram
MAX_DEPTH = 8  # a job spec nests 4 deep (body, op, options, a list inside an option)
MAX_INTEGER_DIGITS = 20  # every integer on the wire fits 64 bits
MAX_STRING = 1024  # characters of one string (addresses, codec names, options)

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")


class JsonRefused(ValueError):
    """A body that is not bounded JSON; the message says which limit it broke."""


def loads(data: bytes | bytearray | memoryview) -> object:
    """The value of a bounded JSON text; ``JsonRefused`` otherwise."""
    raw = bytes(data)
    if len(raw) > MAX_BYTES:
        raise JsonRefused(f"body of {len(raw)} bytes exceeds {MAX_BYTES}")
    depth = _depth(raw)
    if depth > MAX_DEPTH:
        raise JsonRefused(f"JSON nested {depth} deep, at most {MAX_DEPTH}")
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, parse_int=_integer, parse_constant=_constant,
                           parse_float=_float)  # fmt: skip
    except UnicodeDecodeError as error:
        raise JsonRefused(f"body is not UTF-8: {error.reason}") from None
    except json.JSONDecodeError as error:
        raise JsonRefused(f"body is not JSON: {error}") from None
    except (RecursionError, ValueError) as error:  # our parse hooks; RecursionError: never
        raise JsonRefused(str(error)) from None
    _check_strings(value)
    return value


def _depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects, strings ignored (a linear scan, no parse)."""
    structure = _STRINGS.sub(b"", raw)
    depth = deepest = 0
    for byte in structure.translate(None, delete=_NOT_BRACKETS):
        depth += 1 if byte in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INTEGER_DIGITS:
        raise JsonRefused(f"an integer of {len(text)} digits (at most {MAX_INTEGER_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    if len(text) > 64:
        raise JsonRefused(f"a number of {len(text)} characters")
    value = float(text)
    if not math.isfinite(value):
        raise JsonRefused(f"a number out of range: {text[:32]}")
    return value


def _constant(text: str):
    raise JsonRefused(f"{text} is not a JSON number")


def _check_strings(value: object) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            _check_string(item)
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            for key, inner in item.items():
                _check_string(key)
                stack.append(inner)


def _check_string(text: str) -> None:
    if len(text) > MAX_STRING:
        raise JsonRefused(f"a string of {len(text)} characters (at most {MAX_STRING})")
    if _SURROGATE.search(text):
        raise JsonRefused(f"a string with a lone UTF-16 surrogate: {text[:40]!a}")
