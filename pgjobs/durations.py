"""One parser for every duration pgjobs accepts: ``"90s"``, ``"5m"``, ``"1h"``,
``"1h30m"``, ``"250ms"``, a number of seconds, or a :class:`~datetime.timedelta`.

Every duration is finite and at most :data:`MAX_DURATION` (100 years): longer
is a typo, not a schedule, and ``now + duration`` must stay a datetime (Python's
end at year 9999). The timeouts pgjobs hands to PostgreSQL (``lock_timeout``,
``statement_timeout``) are integer milliseconds there: :func:`parse_timeout`
keeps them within :data:`MAX_TIMEOUT` and refuses what would round to "none".
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import TypeAlias

from .errors import ConfigError

Duration: TypeAlias = timedelta | str | int | float

#: the longest duration pgjobs accepts (intervals, backoffs, run retention)
MAX_DURATION = timedelta(days=36525)
#: PostgreSQL's timeouts are integer milliseconds: at most 2147483647 ms (~24.8 days)
MAX_TIMEOUT = timedelta(milliseconds=2**31 - 1)

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def _limit(maximum: timedelta) -> str:
    if maximum == MAX_DURATION:
        return f"100 years ({format_duration(maximum)})"
    if maximum == MAX_TIMEOUT:
        return "2147483647ms (PostgreSQL's timeouts are integer milliseconds)"
    return format_duration(maximum)


def parse_duration(
    value: Duration, *, field: str = "duration", maximum: timedelta = MAX_DURATION
) -> timedelta:
    """Return ``value`` as a non-negative :class:`timedelta`, at most ``maximum``.

    >>> parse_duration("1h30m")
    datetime.timedelta(seconds=5400)

    Raises :class:`ConfigError` naming ``field`` and the value for anything
    else: not a duration, negative, not a number (``nan``), too long (``inf``).
    """
    expected = f"{field}: expected a duration such as '90s', '5m' or '1h', got {value!r}"
    seconds: int | float
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool):
        raise ConfigError(expected)
    elif isinstance(value, int | float):
        seconds = value
    elif isinstance(value, str):
        text = value.strip().lower().replace(" ", "")
        if re.fullmatch(r"\d+(\.\d+)?", text):
            seconds = float(text)
        elif text and _PART.sub("", text) == "":
            seconds = math.fsum(float(n) * _UNITS[u] for n, u in _PART.findall(text))
        else:
            raise ConfigError(expected)
    else:
        raise ConfigError(expected)
    if isinstance(seconds, float) and math.isnan(seconds):
        raise ConfigError(expected)
    if seconds < 0:
        raise ConfigError(f"{field}: must not be negative, got {value!r}")
    # Compared before timedelta() is built: an int of any size, inf or a
    # hundred-digit string would overflow it.
    too_long = ConfigError(f"{field}: must be at most {_limit(maximum)}, got {value!r}")
    if seconds > maximum.total_seconds() + 1:
        raise too_long
    result = value if isinstance(value, timedelta) else timedelta(seconds=seconds)
    if result > maximum:
        raise too_long
    return result


def parse_timeout(value: Duration, *, field: str = "timeout") -> timedelta:
    """A ``lock_timeout`` or ``statement_timeout``: ``0`` (none) or from 1 ms to
    :data:`MAX_TIMEOUT`. A nonzero value under 1 ms is refused: PostgreSQL
    would take it as 0, which means no timeout at all."""
    result = parse_duration(value, field=field, maximum=MAX_TIMEOUT)
    if timedelta(0) < result < timedelta(milliseconds=1):
        raise ConfigError(
            f"{field}: must be 0 (no timeout) or at least 1ms: PostgreSQL counts whole "
            f"milliseconds and would take it as 0, no timeout, got {value!r}"
        )
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


def setting_ms(seconds: float) -> str:
    """A positive timeout as a PostgreSQL setting's value: whole
    milliseconds, at least 1 (``"0ms"`` would turn the timeout off)."""
    return f"{max(1, int(seconds * 1000))}ms"


__all__ = [
    "MAX_DURATION",
    "MAX_TIMEOUT",
    "Duration",
    "format_duration",
    "parse_duration",
    "parse_timeout",
    "setting_ms",
]
