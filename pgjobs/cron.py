"""Checking a job's ``cron`` expression and time zone when the job is
defined (the model does not import APScheduler; the scheduler parses the
expression again), so that a bad one is refused with its config key before
anything runs.
"""

from __future__ import annotations

import re
import zoneinfo

from .errors import ConfigError


def check_text(value: object, field: str, *, what: str = "a non-empty string") -> str:
    """``value`` if it is a non-empty string without a NUL byte (which no
    PostgreSQL text, name or query can hold), else :class:`ConfigError`
    naming ``field`` and the value."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{field}: expected {what}, got {value!r}")
    if "\x00" in value:
        raise ConfigError(f"{field}: must not contain a NUL byte, got {value!r}")
    return value


# -- cron --------------------------------------------------------------------------
# The crontab grammar APScheduler 3's CronTrigger.from_crontab accepts, checked
# here so that a job refuses a bad expression on construction (this module
# does not import APScheduler; the scheduler parses the expression again).
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
#: (field, lowest, highest, names of the values from ``lowest`` on)
_CRON_FIELDS: tuple[tuple[str, int, int, tuple[str, ...]], ...] = (
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day", 1, 31, ()),
    ("month", 1, 12, _MONTHS),
    ("day_of_week", 0, 6, _WEEKDAYS),
)
_CRON_ITEM = re.compile(r"(\*|(\d+)(?:-(\d+))?)(?:/(\d+))?")
_CRON_NAMES = re.compile(r"([a-z]+)(?:-([a-z]+))?")
_MONTH_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def _cron_field(text: str, name: str, low: int, high: int, names: tuple[str, ...]) -> set[int]:
    """The values ``text`` selects in one crontab field; ValueError saying why not."""
    values: set[int] = set()
    for item in text.split(","):
        match = _CRON_ITEM.fullmatch(item)
        if match:
            star, first, last, step = match.groups()
            start = low if star == "*" else int(first)
            end = high if star == "*" or (last is None and step is not None) else int(last or first)
            if not low <= start <= high or not low <= end <= high:
                raise ValueError(f"{name}: {item!r} is outside {low}-{high}")
            if start > end:
                raise ValueError(f"{name}: {item!r} is a range from high to low")
            if step is not None and not 1 <= int(step) <= end - start:
                raise ValueError(
                    f"{name}: {item!r}: a step must be from 1 to the width of its range "
                    f"({end - start})"
                )
            values.update(range(start, end + 1, int(step or 1)))
            continue
        match = _CRON_NAMES.fullmatch(item.lower())
        if match and names and all(n is None or n in names for n in match.groups()):
            first, last = match.groups()
            start = names.index(first) + low
            end = names.index(last) + low if last else start
            if start > end:
                raise ValueError(f"{name}: {item!r} is a range from high to low")
            values.update(range(start, end + 1))
            continue
        if name == "day" and item.lower() == "last":
            values.add(28)  # every month has one
            continue
        known = f", or names ({', '.join(names)})" if names else ""
        extra = ", or last" if name == "day" else ""
        raise ValueError(f"{name}: {item!r} is not *, N, N-M or a step (*/N, N-M/S){known}{extra}")
    return values


def check_timezone(value: object, field: str) -> str:
    """An IANA time zone name (``"Europe/Paris"``, ``"UTC"``)."""
    text = check_text(value, field, what="an IANA time zone such as 'UTC' or 'Europe/Paris'")
    try:
        zoneinfo.ZoneInfo(text)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
        raise ConfigError(
            f"{field}: expected an IANA time zone such as 'UTC' or 'Europe/Paris', got {value!r}"
        ) from exc
    return text


def check_cron(value: object, field: str) -> str:
    """A crontab expression: minute, hour, day of month, month, day of week
    (APScheduler 3's numbering: 0 is Monday; names ``mon``-``sun`` are clearer).
    :class:`ConfigError` naming ``field``, the fault and the value otherwise."""
    text = check_text(value, field, what="a crontab expression such as '*/5 * * * *'")
    parts = text.split()
    if len(parts) != 5:
        raise ConfigError(
            f"{field}: expected 5 crontab fields (minute hour day month day_of_week), got {value!r}"
        )
    try:
        selected = [_cron_field(p, *spec) for p, spec in zip(parts, _CRON_FIELDS, strict=True)]
    except ValueError as exc:
        raise ConfigError(f"{field}: {exc}, got {value!r}") from None
    days, months = selected[2], selected[3]
    if parts[2] != "*" and not any(min(days) <= _MONTH_DAYS[m - 1] for m in months):
        raise ConfigError(
            f"{field}: no month it names has the day it names: it never fires, got {value!r}"
        )
    return text


__all__ = ["check_cron", "check_text", "check_timezone"]
