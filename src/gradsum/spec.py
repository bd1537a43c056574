"""The one grammar for a named thing with options, as every command line and the Python API
write it: ``NAME(option=value,...)`` for codecs, schedulers and model sizes,
``AGGREGATOR:CODEC(...)`` for methods (train/methods.py), and lists of either split at the commas
outside parentheses. Light: command lines parse with it before torch is imported.

Values are typed by what they look like (``4``, ``0.5``, ``1/32``, ``true``, ``none``), then
checked against the type the option declares (:func:`check_options`), so that ``correlated=maybe``
is refused where it is written instead of taken as true somewhere later.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass


def split_spec(spec: str) -> tuple[str, str]:
    """``NAME(option=value,...)`` → its name and its options' text (empty without options)."""
    name, bracket, options = spec.strip().partition("(")
    if bracket and not options.endswith(")"):
        raise ValueError(f"{spec!r}: options go as NAME(option=value,...)")
    return name.strip(), options.removesuffix(")").strip()


def parse_options(text: str, what: str = "codec option") -> dict[str, object]:
    """Parse ``"bits=4,granularity=30,p=0.03125"`` into typed values (``what``: the option's
    kind, for the error)."""
    options: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{what} {item!r} is not of the form name=value")
        options[key.strip()] = parse_value(value.strip())
    return options


def parse_value(value: str) -> object:
    """A value as written: an int, a float (``1/32`` too), true/false, none (or full, for "no
    limit"), else the word itself."""
    for convert in (int, float):
        try:
            return convert(value)
        except ValueError:
            continue
    if value.lower() in ("none", "full"):
        return None
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    if "/" in value:
        numerator, _, denominator = value.partition("/")
        try:
            return float(numerator) / float(denominator)
        except (ValueError, ZeroDivisionError):
            return value
    return value


def split_list(text: str, flag: str) -> list[str]:
    """A flag's comma-separated list of specs, split at the commas outside parentheses so that
    an item's options may hold commas of their own: ``ddp,switch:thc(correlated=true,bits=4)``.
    ValueError naming ``flag`` when the parentheses do not balance or nothing is listed."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text + ","):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth < 0:
            raise ValueError(f"{flag} {text!r}: a ')' without its '('")
        if char == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    if depth:
        raise ValueError(f"{flag} {text!r}: a '(' without its ')'")
    items = [item for item in items if item]
    if not items:
        raise ValueError(f"{flag} is empty")
    return items


@dataclass(frozen=True)
class Option:
    """An option's default and the types it takes (``{"int", "None"}``; empty: anything);
    ``words``: the values a word-valued option takes (None: any word)."""

    default: object
    types: frozenset[str]
    words: tuple[str, ...] | None = None


def signature_options(function: Callable, skip: Iterable[str] = ("self",)) -> dict[str, Option]:
    """The keyword options of ``function`` (a class's ``__init__``, a planner): each default
    and the types its annotation names, or its default's type where it has none."""
    options = {}
    for p in inspect.signature(function).parameters.values():
        if p.name in skip or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        options[p.name] = Option(p.default, _types(p.annotation, p.default))
    return options


def _types(annotation: object, default: object) -> frozenset[str]:
    if isinstance(annotation, str):  # postponed annotations: "int | None"
        return frozenset(part.strip() for part in annotation.split("|"))
    if isinstance(annotation, type) and annotation is not inspect.Parameter.empty:
        return frozenset({annotation.__name__})
    if default is None or default is inspect.Parameter.empty:
        return frozenset()
    return frozenset({type(default).__name__})


_WANTED = {"bool": "true or false", "int": "an integer", "float": "a number", "None": "none",
           "str": "a word"}  # fmt: skip


def check_options(kind: str, name: str, given: dict, accepted: dict[str, Option]) -> dict:
    """``given`` checked against ``accepted``: every option one that ``name`` has, every value of
    a type it takes (an integer where a number is wanted becomes a float). ValueError naming the
    option and listing the valid ones, e.g. "codec 'thc' has no option bogus; its options are
    bits, granularity, ..."."""
    listed = ", ".join(accepted) or "(none)"
    unknown = [key for key in given if key not in accepted]
    if unknown:
        raise ValueError(
            f"{kind} {name!r} has no option {', '.join(unknown)}; its options are {listed}"
        )
    checked = {}
    for key, value in given.items():
        types, words = accepted[key].types, accepted[key].words
        checked[key] = value
        if isinstance(value, str) and words is not None and value not in words:
            raise ValueError(
                f"{kind} {name!r}: {key}={value} is not one of {', '.join(words)}; its options "
                f"are {listed}"
            )
        if not types or _takes(types, value):
            continue
        if isinstance(value, int) and not isinstance(value, bool) and "float" in types:
            checked[key] = float(value)
            continue
        wanted = " or ".join(_WANTED.get(t, t) for t in sorted(types, key=_order))
        raise ValueError(
            f"{kind} {name!r}: {key}={_shown(value)} is not {wanted}; its options are {listed}"
        )
    return checked


def _shown(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return "none" if value is None else str(value)


def _takes(types: frozenset[str], value: object) -> bool:
    if isinstance(value, bool):
        return "bool" in types
    if value is None:
        return "None" in types
    return type(value).__name__ in types


def _order(type_name: str) -> int:
    order = ("bool", "int", "float", "str", "None")
    return order.index(type_name) if type_name in order else len(order)
