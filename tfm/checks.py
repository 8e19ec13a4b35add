"""ConfigError and the validators every config section uses (model, data, train, mesh, ...).

`field` is the name an error shows (e.g. "data.batch_size" or "beam_size"); each check raises
ConfigError naming it and what is allowed. Nothing here imports the rest of tfm, so every
package can use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what is allowed."""


def check_choice(field: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{field}={value!r} is unknown; choose one of: {', '.join(allowed)}")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive(field: str, value: Any, allow_zero: bool = False) -> None:
    """An integer > 0 (or >= 0)."""
    if not (_is_int(value) and (value >= 0 if allow_zero else value > 0)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{field}={value!r} must be an integer {bound}")


def check_int(field: str, value: Any, minimum: int, note: str = "") -> None:
    """An integer >= minimum; `note` explains a special value, e.g. "(0 = all)"."""
    if not (_is_int(value) and value >= minimum):
        raise ConfigError(f"{field}={value!r} must be an integer >= {minimum}{note}")


def check_number(field: str, value: Any, allowed: str, ok: Callable[[float], bool]) -> None:
    """A real number (not a bool) for which ok(value) holds; `allowed` words the range."""
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (is_number and ok(value)):
        raise ConfigError(f"{field}={value!r} must be {allowed}")


def check_bool(field: str, value: Any, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        allowed = "True, False or None" if optional else "True or False"
        raise ConfigError(f"{field}={value!r} must be one of: {allowed}")


def check_rate(field: str, value: Any) -> None:
    """A number in [0, 1) (a dropout rate)."""
    check_number(field, value, "a number in [0, 1)", lambda v: 0.0 <= v < 1.0)


def section_dict(values: Any, section: str, known: Sequence[str]) -> dict[str, Any]:
    """A config section (dict, ConfigDict or None) as a plain dict; unknown keys raise
    ConfigError naming `section.key` and the known fields."""
    given = {} if values is None else (
        values.to_dict() if hasattr(values, "to_dict") else dict(values))
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(
            f"{', '.join(f'{section}.{key}' for key in unknown)} is unknown; known "
            f"{section} fields: {', '.join(known)}"
        )
    return given


@contextlib.contextmanager
def field_prefix(section: str) -> Iterator[None]:
    """Inside it, a ConfigError's field gets the section's name: "temperature=0" becomes
    "generate.temperature=0" when a section checks its fields with another module's config.
    An error that already names the section ("model.foo is unknown") is left as it is."""
    try:
        yield
    except ConfigError as error:
        if str(error).startswith(f"{section}."):
            raise
        raise ConfigError(f"{section}.{error}") from None


def field_defaults(cls: type) -> dict[str, Any]:
    """{field: default} of a config dataclass (what configs/base.py exposes as overridable)."""
    return {field.name: field.default for field in dataclasses.fields(cls)}
