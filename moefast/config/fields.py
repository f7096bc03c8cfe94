"""What every config section builds on: :class:`ConfigError` and the checks of a value against
its field's type (``Literal`` choices, unions, tuples of a type, int -> float), each error naming
the key and, for a typo, the closest valid name."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or impossible."""


def _suggest(name: str, valid) -> str:
    valid = list(valid)
    same = [v for v in valid if v.lower() == name.lower()]  # a case-only slip ('FP8') first
    close = same or difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _check_choices(obj: Any, section: str) -> None:
    """Every ``Literal`` field of a section holds one of its choices (also when the dataclass is
    built in code, not only through :func:`load_config`)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if typing.get_origin(hints[f.name]) is Literal:
            _coerce(f"{section}.{f.name}", getattr(obj, f.name), hints[f.name])


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")



def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Checks ``value`` against a type annotation, converting int -> float where allowed."""
    origin = typing.get_origin(typ)
    if origin is Literal:
        choices = typing.get_args(typ)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}"
                              f"{_suggest(str(value), [str(c) for c in choices])}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(typ)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(key, value, a)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) == 1:  # X or null: X's own message (it names a bad list entry)
            raise ConfigError(errors[0])
        raise ConfigError(f"{key}: {value!r} does not fit {_type_name(typ)}")
    if origin is tuple:  # tuple[X, ...]: a YAML list
        (item, _) = typing.get_args(typ)
        if isinstance(value, (list, tuple)):
            return tuple(_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
    elif typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - guards new field types
        raise ConfigError(f"{key}: unsupported field type {typ!r}")
    raise ConfigError(f"{key}: expected {_type_name(typ)}, got {value!r} ({type(value).__name__})")


def _type_name(typ: Any) -> str:
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _type_name(a) for a in typing.get_args(typ))
    if typing.get_origin(typ) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(typ))
    if typing.get_origin(typ) is tuple:
        return f"a list of ({_type_name(typing.get_args(typ)[0])})"
    return getattr(typ, "__name__", str(typ))
