"""How long a failed job waits before its next attempt."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from datetime import timedelta

from .durations import Duration, format_duration, parse_duration
from .errors import ConfigError


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True, slots=True)
class Backoff:
    """Delay after the n-th consecutive failure: ``initial * factor**(n-1)``,
    capped at ``max``, spread by ``±jitter`` (a fraction).

    The field report's rule, "back off 1 h after a failure", is one line::

        Backoff(initial="1h")

    The delay is persisted (``pgjobs.job_state.next_attempt_at``), so every
    replica and every restart honours it; one success resets it. ``initial``
    and ``max`` are durations of at most 100 years; ``max`` defaults to
    ``initial`` without a factor, else to ``max(initial, 24h)``.
    """

    initial: Duration = "1h"
    factor: float = 1.0
    max: Duration | None = None
    jitter: float = 0.0

    def __post_init__(self) -> None:
        initial = parse_duration(self.initial, field="backoff.initial")
        object.__setattr__(self, "initial", initial)
        if not _number(self.factor) or self.factor < 1:
            raise ConfigError(f"backoff.factor: must be a number >= 1, got {self.factor!r}")
        if not _number(self.jitter) or not 0 <= self.jitter < 1:
            raise ConfigError(f"backoff.jitter: must be a fraction in [0, 1), got {self.jitter!r}")
        # an int factor would make factor ** n exact big-integer arithmetic
        object.__setattr__(self, "factor", float(self.factor))
        object.__setattr__(self, "jitter", float(self.jitter))
        cap = initial if self.max is None and self.factor == 1.0 else self.max
        if cap is None:
            cap = max(initial, timedelta(hours=24))
        cap = parse_duration(cap, field="backoff.max")
        if cap < initial:
            raise ConfigError(
                f"backoff.max: must not be shorter than backoff.initial "
                f"({format_duration(initial)}), got {self.max!r}"
            )
        object.__setattr__(self, "max", cap)

    @classmethod
    def coerce(cls, value: Backoff | Duration, *, field: str = "backoff") -> Backoff:
        """Accept a :class:`Backoff` or a duration meaning ``Backoff(initial=duration)``."""
        if isinstance(value, Backoff):
            return value
        return cls(initial=parse_duration(value, field=field))

    def delay(self, failures: int, *, rng: random.Random | None = None) -> timedelta:
        """The wait after ``failures`` consecutive failures (``failures >= 1``)."""
        assert isinstance(self.initial, timedelta) and isinstance(self.max, timedelta)
        n = max(failures, 1)
        initial, cap = self.initial.total_seconds(), self.max.total_seconds()
        # Compared in log space first: factor ** (n - 1) overflows a float (an
        # OverflowError) after some hundreds of failures, long after the cap.
        if initial == 0 or self.factor == 1:
            seconds = min(initial, cap)
        elif (n - 1) * math.log(self.factor) >= math.log(cap / initial):
            seconds = cap
        else:
            seconds = min(initial * self.factor ** (n - 1), cap)
        if self.jitter:
            seconds *= 1 + (rng or random).uniform(-self.jitter, self.jitter)
        return timedelta(seconds=seconds)


__all__ = [
    "Backoff",
]
