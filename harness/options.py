"""How `deepinfer-bench` reads the values of its options: one parser for every whole number, number list and name
list, so every option takes the same forms and refuses the same way (docs/errors.md: one line naming the option
and the bad item, exit 2).

Whole numbers are ASCII decimal digits only. `str.isdigit` and `int()` take more than a user means: superscripts
('²' passes isdigit and then breaks int()), other scripts' digits ('٣' is 3 to int()), '1_000', '+3'.

    parse_count("16", "--batch", minimum=1)              -> 16
    parse_int_list("1,16,64", "--batch")                 -> (1, 16, 64)
    parse_names("off,fixed", "--modes", MODES)           -> ("off", "fixed")
    click.option("--iters", type=Count(1), default=20)   # the same rule for an option's single value"""

from __future__ import annotations

import re

import click

from deepinfer.errors import DeepInferError

DIGITS = re.compile(r"[0-9]+")
DECIMAL = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")       # 0.5, .5, 1, 1.: no sign, exponent, nan or inf


SEED_MAX = 2 ** 31 - 1     # seeds feed torch generators after the benches' own arithmetic (seed x 1_000_003 + i)


def parse_count(text, option: str, minimum: int = 0, maximum: int | None = None) -> int:
    """A whole number in minimum..maximum written in ASCII digits; anything else is one line naming the option."""
    item = str(text).strip()
    if not DIGITS.fullmatch(item):
        raise DeepInferError(f"{option} {text!r}: give a whole number >= {minimum} in ASCII digits (0-9)")
    if int(item) < minimum:                   # the wording of the benches' own range checks (their Python API)
        raise DeepInferError(f"{option} must be at least {minimum}, got {int(item)}")
    if maximum is not None and int(item) > maximum:
        raise DeepInferError(f"{option} must be at most {maximum}, got {int(item)}")
    return int(item)


def split_items(text: str, option: str, example: str) -> list[str]:
    """'a, b' -> ['a', 'b']; an empty item (',', 'a,,b', 'a,') is one line: it is never read as 'left out'."""
    items = [item.strip() for item in str(text).split(",")]
    if not all(items):
        raise DeepInferError(f"{option} {text!r} has an empty item; give comma-separated values, e.g. {example}")
    return items


def check_distinct(option: str, values, text: str | None = None) -> None:
    """A list whose items name points or runs: a repeat would run the same point twice (and keep one row).
    `text`: the list as the user wrote it, for the message."""
    seen = set()
    for v in values:
        if v in seen:
            shown = text if text is not None else ",".join(map(str, values))
            raise DeepInferError(f"{option} {shown!r} lists {v} twice; give each value once")
        seen.add(v)


def parse_int_list(text: str | None, option: str, minimum: int = 1, example: str = "1,16,64") -> tuple[int, ...]:
    """'1,16,64' -> (1, 16, 64): distinct whole numbers >= minimum. None or '' -> () (the option left out)."""
    if text is None or str(text).strip() == "":
        return ()
    values = []
    for item in split_items(text, option, example):
        if not DIGITS.fullmatch(item) or int(item) < minimum:
            raise DeepInferError(f"{option} {text!r}: give a comma-separated list of integers >= {minimum} in ASCII "
                                 f"digits (0-9), e.g. {example}; {item!r} is not one")
        values.append(int(item))
    check_distinct(option, values, text)
    return tuple(values)


def parse_decimal_list(text: str, option: str, example: str, noun: str = "numbers",
                       distinct: bool = True) -> tuple[float, ...]:
    """'0,0.5,1' -> (0.0, 0.5, 1.0): plain ASCII decimals (no sign, exponent, nan or inf); repeats refused unless
    the list is a curve whose values may repeat (distinct=False). `noun` says what the values are, in the message."""
    values = []
    for item in split_items(text, option, example):
        if not DECIMAL.fullmatch(item):
            raise DeepInferError(f"{option} {text!r}: give comma-separated {noun} as plain decimals (digits 0-9 and "
                                 f"one '.'), e.g. {example}; {item!r} is not one")
        values.append(float(item))
    if distinct:
        check_distinct(option, values, text)
    return tuple(values)


def check_names(option: str, names, choices, text: str | None = None) -> tuple[str, ...]:
    """At least one name, each one of `choices`, none twice. `text`: the list as the user wrote it."""
    names = tuple(names)
    shown = text if text is not None else ",".join(names)
    unknown = [n for n in names if n not in choices]
    if unknown or not names:
        raise DeepInferError(f"{option} {shown!r}: choose from {', '.join(choices)} "
                             f"({', '.join(map(repr, unknown)) or 'nothing'} is not one)")
    check_distinct(option, names, text)
    return names


def parse_names(text: str, option: str, choices) -> tuple[str, ...]:
    """'off,fixed' -> ('off', 'fixed'): names from `choices`, comma-separated, none twice."""
    return check_names(option, split_items(text, option, ",".join(list(choices)[:2])), choices, text)


def option_name(param) -> str:
    """The long name of a click option ('--batch'), as the messages above name it."""
    opts = getattr(param, "opts", None) or [getattr(param, "name", "value")]
    return max(opts, key=len)


class Count(click.ParamType):
    """A click type for one whole number >= minimum, through parse_count (click's INT takes what int() takes)."""
    name = "integer"

    def __init__(self, minimum: int = 0, maximum: int | None = None):
        self.minimum, self.maximum = minimum, maximum

    def convert(self, value, param, ctx):
        if isinstance(value, int) and not isinstance(value, bool) and value >= self.minimum and \
                (self.maximum is None or value <= self.maximum):
            return value                                          # a default, already a number
        return parse_count(value, option_name(param), self.minimum, self.maximum)


SEED = Count(0, SEED_MAX)
