"""One parser for every duration pgjobs accepts: ``"90s"``, ``"5m"``, ``"1h"``,
``"1h30m"``, ``"250ms"``, a number of seconds, or a :class:`~datetime.timedelta`."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import TypeAlias

from .errors import ConfigError

Duration: TypeAlias = timedelta | str | int | float

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def parse_duration(value: Duration, *, field: str = "duration") -> timedelta:
    """Return ``value`` as a non-negative :class:`timedelta`.

    >>> parse_duration("1h30m")
    datetime.timedelta(seconds=5400)

    Raises :class:`ConfigError` naming ``field`` for anything else.
    """
    if isinstance(value, timedelta):
        result = value
    elif isinstance(value, bool):
        raise ConfigError(
            f"{field}: expected a duration such as '90s', '5m' or '1h', got {value!r}"
        )
    elif isinstance(value, int | float):
        result = timedelta(seconds=value)
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if re.fullmatch(r"\d+(\.\d+)?", text):
            result = timedelta(seconds=float(text))
        elif text and _PART.sub("", text) == "":
            seconds = sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))
            result = timedelta(seconds=seconds)
        else:
            raise ConfigError(
                f"{field}: expected a duration such as '90s', '5m' or '1h', got {value!r}"
            )
    else:
        raise ConfigError(
            f"{field}: expected a duration such as '90s', '5m' or '1h', got {value!r}"
        )
    if result < timedelta(0):
        raise ConfigError(f"{field}: must not be negative, got {value!r}")
    return result


def format_duration(value: timedelta) -> str:
    """``timedelta(seconds=5400)`` -> ``"1h30m"``; the inverse of :func:`parse_duration`."""
    total = value.total_seconds()
    if total < 1 and total > 0:
        return f"{round(total * 1000)}ms"
    seconds = round(total)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size:
            parts.append(f"{seconds // size}{unit}")
            seconds %= size
    return "".join(parts) or "0s"
