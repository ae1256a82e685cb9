"""Declared settings: each config field carries its own rule (type, choices, range), checked in one place.

``setting(default, ...)`` is a ``dataclasses.field`` whose metadata holds a ``Rule``; ``check_settings(obj)`` checks
every field of a config dataclass against its rule, and ``check_value(rule, name, value)`` checks one value (the
data loader uses it for the same fields when called directly). A ``Section`` (one of ``RunConfig``'s) checks its
fields as it is built, then its own rules. Every message names the field, the value and what is allowed, e.g.
``batch_size=0 is invalid: expected an integer >= 1.``
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """An invalid run configuration: the message names the field, the value and what is allowed."""

    def _render_traceback_(self) -> list[str]:  # IPython's hook: a notebook shows the message, not a traceback
        return [f"{type(self).__name__}: {self}"]


@dataclass(frozen=True)
class Rule:
    """What a setting accepts. Bounds are inclusive (``minimum``, ``maximum``) or exclusive (``above``, ``below``)."""

    kind: type | None = None
    """``int``, ``float``, ``bool`` or ``str``; ``None`` accepts anything (free-form fields)."""
    optional: bool = False
    """``None`` is allowed too."""
    choices: tuple = ()
    minimum: float | None = None
    maximum: float | None = None
    above: float | None = None
    below: float | None = None
    hint: str = ""
    """Appended to the message in parentheses: what the bound is for."""


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **rule: Any) -> Any:
    """A dataclass field checked by ``check_settings`` against ``Rule(**rule)``."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"rule": Rule(**rule)})


def rule_of(cls_or_obj: Any, name: str) -> Rule:
    return next(f.metadata["rule"] for f in dataclasses.fields(cls_or_obj) if f.name == name)


def check_settings(obj: Any) -> None:
    """Checks every field of the dataclass ``obj`` that was declared with ``setting``."""
    for f in dataclasses.fields(obj):
        if "rule" in f.metadata:
            check_value(f.metadata["rule"], f.name, getattr(obj, f.name))


class Section:
    """Base of a config section, a frozen dataclass of ``setting`` fields: once built it checks every field against
    its rule, then ``check()``, the rules among its own fields."""

    def __post_init__(self) -> None:
        check_settings(self)
        self.check()

    def check(self) -> None:
        """The rules that tie this section's fields together (none unless a section declares them)."""


def check_value(rule: Rule, name: str, value: Any) -> None:
    if value is None and rule.optional:
        return
    if rule.choices:
        if value not in rule.choices:
            raise ConfigError(f"{name}={value!r} is not known: choose one of {', '.join(map(str, rule.choices))}.")
        return
    if rule.kind is None:
        return
    if not _has_kind(value, rule.kind) or not _in_bounds(rule, value):
        hint = f" ({rule.hint})" if rule.hint else ""
        raise ConfigError(f"{name}={value!r} is invalid: expected {_describe(rule)}{hint}.")


def _has_kind(value: Any, kind: type) -> bool:
    if kind is bool or isinstance(value, bool):
        return isinstance(value, bool) and kind is bool
    if kind is float:
        return isinstance(value, (int, float)) and not math.isnan(value)
    return isinstance(value, kind)


def _in_bounds(rule: Rule, value: Any) -> bool:
    return ((rule.minimum is None or value >= rule.minimum) and (rule.maximum is None or value <= rule.maximum)
            and (rule.above is None or value > rule.above) and (rule.below is None or value < rule.below))


def _describe(rule: Rule) -> str:
    if rule.kind is bool:
        return "true or false"
    if rule.kind is str:
        return "a string" + (" or None" if rule.optional else "")
    noun = "an integer" if rule.kind is int else "a number"
    low = (f"[{rule.minimum:g}" if rule.minimum is not None else f"({rule.above:g}" if rule.above is not None
           else None)
    high = (f"{rule.maximum:g}]" if rule.maximum is not None else f"{rule.below:g})" if rule.below is not None
            else None)
    if low and high:
        text = f"{noun} in {low}, {high}"
    elif rule.above == 0 and rule.kind is float:
        text = "a positive number"
    elif low:
        text = f"{noun} {'>=' if low[0] == '[' else '>'} {low[1:]}"
    elif high:
        text = f"{noun} {'<=' if high[-1] == ']' else '<'} {high[:-1]}"
    else:
        text = noun
    return text + (" or None" if rule.optional else "")


def parse_value(text: str) -> Any:
    """A ``--set`` value from the command line: true/false, none, an int, a float, else the string."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text
