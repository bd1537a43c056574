"""Configuration declared once: sections of typed fields, each field with its one flag.

A section is a dataclass whose fields are declared with :func:`setting`: the default, the flag's
help, how the flag's text becomes the value (and back, for a command line that starts another),
and when the field applies at all. A job's configuration (``train.config.TrainConfig``) inherits
the sections it is made of, so its field names stay flat (``config.codec``). A command offers the
sections it uses (:func:`add_flags`), builds its configuration from the flags given on its
command line and checks it (:func:`config_from`) before anything starts. A benchmark that runs
a field over several values offers the field's sweep (``--seeds`` for ``--seed``) instead, under
the name the field declares.

Light: the command line parses with it before torch is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, dataclass
from typing import ClassVar

# where a field's value comes from another field's flag (``codec_options`` from ``--codec``)
_PART_OF = "part_of"
_SETTING = "setting"


@dataclass(frozen=True)
class Setting:
    """How one field is set from a command line; see :func:`setting`."""

    help: str | None = None
    parse: Callable[[str], object] | None = None
    choices: Sequence | None = None
    metavar: str | None = None
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    sweep: str | None = None
    applies: Callable[[object], str | None] | None = None
    sets: tuple[str, ...] = ()
    show: Callable[[object], str] = str
    shown_default: str | None = None


def setting(default=MISSING, *, default_factory=MISSING, **how) -> dataclasses.Field:
    """A section's field with its flag (``--batch-size`` for ``batch_size`` unless ``flag`` names
    another). ``how``: :class:`Setting`'s fields: ``help``; ``parse``, the flag's text to the
    value (argparse's ``type``; an ``argparse.ArgumentTypeError`` is a usage error);
    ``choices``; ``metavar``; ``aliases``, other spellings of the flag (where the first clashes
    with a launcher's own flags); ``sweep``, the list flag a benchmark offers instead to run
    several values; ``applies(config)``, None where the field applies, else why not ("applies to
    --aggregator ddp only"): a flag given where it does not apply is refused; ``sets``, the
    fields one value sets, when it sets several (``parse`` then returns one value each);
    ``show``, the value back to the flag's text; ``shown_default``, what ``--help`` says of the
    field's own default where that is resolved later ("cuda when present")."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={_SETTING: Setting(**how)})  # fmt: skip


def part_of(owner: str, default) -> dataclasses.Field:
    """A field set by another field's flag (``codec_options`` by ``--codec``)."""
    return dataclasses.field(default=default, metadata={_PART_OF: owner})


@dataclass(frozen=True)
class Sweep:
    """A list flag a benchmark offers instead of the fields that declare it as their ``sweep``,
    to run each of several values (``--seeds 0,1,2`` for ``--seed``)."""

    flag: str
    help: str


class Section:
    """A group of fields: ``title`` heads its flags in ``--help``; ``check`` is its own
    validation, run on the whole configuration (ValueError naming the flag at fault)."""

    title: ClassVar[str] = ""

    def check(self) -> None:
        return None


@dataclass(frozen=True)
class Flag:
    """A field's flag as a command offers it."""

    field: str
    name: str
    setting: Setting
    section: type[Section]

    @property
    def fields(self) -> tuple[str, ...]:
        return self.setting.sets or (self.field,)

    def value(self, config) -> object:
        values = tuple(getattr(config, name) for name in self.fields)
        return values if self.setting.sets else values[0]

    def text(self, value) -> str:
        return "none" if value is None else self.setting.show(value)


def sections_of(config_class: type) -> list[type[Section]]:
    """The sections a configuration class is made of, in the order it lists them."""
    return [base for base in config_class.__bases__ if issubclass(base, Section)]


def flags_of(sections: Iterable[type[Section]]) -> list[Flag]:
    """Every field's flag in ``sections``, in declaration order."""
    flags = []
    for section in sections:
        for field in dataclasses.fields(section):
            how = field.metadata.get(_SETTING)
            if how is None:
                if _PART_OF not in field.metadata:
                    raise TypeError(f"{section.__name__}.{field.name} declares no flag")
                continue
            name = how.flag or "--" + field.name.replace("_", "-")
            flags.append(Flag(field.name, name, how, section))
    return flags


def add_flags(parser: argparse.ArgumentParser, sections: Iterable[type[Section]], defaults,
              sweeps: dict[Sweep, str] | None = None,
              only: Iterable[str] | None = None) -> None:  # fmt: skip
    """Add the flags of ``sections`` to ``parser``, one argument group a section, ``--help``
    showing ``defaults``' values. ``sweeps``: list flags offered instead of the fields they
    sweep, each with its default text. ``only``: just these fields. A field's flag that is not
    given leaves no attribute (:func:`given`)."""
    sweeps = sweeps or {}
    swept = {sweep.flag for sweep in sweeps}
    for sweep, default in sweeps.items():
        parser.add_argument(sweep.flag, default=default, help=f"{sweep.help} (default: {default})")
    only = None if only is None else set(only)
    groups: dict[type, argparse._ArgumentGroup] = {}
    for flag in flags_of(sections):
        how = flag.setting
        if how.sweep in swept or (only is not None and flag.field not in only):
            continue
        if flag.section not in groups:
            groups[flag.section] = parser.add_argument_group(flag.section.title)
        value = flag.value(defaults)
        own = how.shown_default is not None and value == flag.value(flag.section())
        default = how.shown_default if own else flag.text(value)
        help_text = f"{how.help or ''} (default: {default})".strip()
        if isinstance(value, bool) and how.parse is None:
            groups[flag.section].add_argument(
                flag.name, *how.aliases, dest=flag.field, action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS, help=help_text,
            )  # fmt: skip
            continue
        groups[flag.section].add_argument(
            flag.name, *how.aliases, dest=flag.field, type=how.parse, choices=how.choices,
            metavar=how.metavar, default=argparse.SUPPRESS, help=help_text.replace("%", "%%"),
        )  # fmt: skip


def given(args: argparse.Namespace, sections: Iterable[type[Section]],
          only: Iterable[str] | None = None) -> dict[str, object]:  # fmt: skip
    """The fields the command line set, with their values (``only``: as :func:`add_flags`)."""
    values: dict[str, object] = {}
    for flag in flags_of(sections):
        if flag.field in vars(args) and (only is None or flag.field in only):
            value = getattr(args, flag.field)
            values.update(zip(flag.fields, value, strict=True) if flag.setting.sets
                          else {flag.field: value})  # fmt: skip
    return values


def config_from(args: argparse.Namespace, sections: Sequence[type[Section]], defaults):
    """``defaults`` with the fields the command line set, checked (:func:`check`)."""
    config = dataclasses.replace(defaults, **given(args, sections))
    check([config], set(given(args, sections)), sections)
    return config


def runs_from(args: argparse.Namespace, sections: Sequence[type[Section]], defaults,
              runs: Iterable[dict]) -> tuple[object, list]:  # fmt: skip
    """A benchmark's configurations: ``defaults`` with the fields the command line set (the
    base), then each run's fields over it (its method, scheduler, seed). All are checked
    together (:func:`check`); returns the base and the runs."""
    base = dataclasses.replace(defaults, **given(args, sections))
    configs = [dataclasses.replace(base, **fields) for fields in runs]
    check(configs, set(given(args, sections)), sections)
    return base, configs


def check(configs: Sequence, set_fields: set[str], sections: Iterable[type[Section]]) -> None:
    """Refuse a flag given where it applies to none of ``configs`` (a benchmark's runs; one
    config for a plain run), then run each section's check on each config. UsageError naming
    the flag."""
    from .cli import UsageError

    sections = list(sections)
    for flag in flags_of(sections):
        applies = flag.setting.applies
        if applies is None or not set_fields & set(flag.fields):
            continue
        reasons = [applies(config) for config in configs]
        if all(reasons):
            text = flag.text(flag.value(configs[0]))
            every = " (in every run)" if len(configs) > 1 else ""
            raise UsageError(f"{flag.name} {text}: {reasons[0]}{every}")
    for config in configs:
        for section in sections:
            try:
                section.check(config)
            except ValueError as error:
                raise UsageError(str(error)) from None


def to_flags(config, sections: Iterable[type[Section]], defaults,
             skip: Iterable[str] = ()) -> list[str]:  # fmt: skip
    """The command line that sets ``config`` in a command whose defaults are ``defaults``: a
    flag for each field that differs from its default and applies (``skip``: fields the caller
    sets itself)."""
    argv: list[str] = []
    skip = set(skip)
    for flag in flags_of(sections):
        if flag.field in skip:
            continue
        value = flag.value(config)
        if value == flag.value(defaults):
            continue
        if flag.setting.applies is not None and flag.setting.applies(config):
            continue
        if isinstance(value, bool) and flag.setting.parse is None:
            argv.append(flag.name if value else "--no-" + flag.name.removeprefix("--"))
        else:
            argv += [flag.name, flag.text(value)]
    return argv


def refuse_flag(parser: argparse.ArgumentParser, flag: str, instead: str) -> None:
    """``flag`` as a usage error that says what to write ``instead`` (``{}``: the value given),
    for a flag whose value now goes elsewhere; hidden from ``--help``."""

    class Refused(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            parser.error(f"{option_string} is not a flag: {instead.format(values)}")

    parser.add_argument(flag, action=Refused, help=argparse.SUPPRESS)


# value types: a flag's text to its value, argparse.ArgumentTypeError naming what is wrong


def argument_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """``parse`` as an argparse type: its ValueError's message is the usage error's (argparse
    would say only "invalid value")."""

    def checked(text: str) -> object:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    checked.__name__ = parse.__name__
    return checked


def positive_int(text: str) -> int:
    return _int_from(text, 1)


def non_negative_int(text: str) -> int:
    return _int_from(text, 0)


def _int_from(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def fixed_cost(text: str) -> tuple[float, float]:
    """``--fixed-cost``'s value: (α s per message, β s per byte), α >= 0 and β > 0."""
    parts = text.split(",")
    try:
        alpha, beta = (float(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: want ALPHA,BETA, seconds per message and seconds per byte"
        ) from None
    if not (0 <= alpha < float("inf") and 0 < beta < float("inf")):
        raise argparse.ArgumentTypeError(
            f"{text!r}: α must be >= 0 s and β > 0 s per byte, both finite"
        )
    return alpha, beta


def address_list(text: str) -> list[str]:
    """Comma-separated HOST:PORT addresses."""
    return [item.strip() for item in text.split(",") if item.strip()]
