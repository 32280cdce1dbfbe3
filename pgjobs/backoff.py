"""How long a failed job waits before its next attempt."""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import timedelta

from .durations import Duration, parse_duration
from .errors import ConfigError


@dataclass(frozen=True, kw_only=True, slots=True)
class Backoff:
    """Delay after the n-th consecutive failure: ``initial * factor**(n-1)``,
    capped at ``max``, spread by ``±jitter`` (a fraction).

    The field report's rule, "back off 1 h after a failure", is one line::

        Backoff(initial="1h")

    The delay is persisted (``pgjobs.job_state.next_attempt_at``), so every
    replica and every restart honours it; one success resets it.
    """

    initial: Duration = "1h"
    factor: float = 1.0
    max: Duration | None = None
    jitter: float = 0.0

    def __post_init__(self) -> None:
        initial = parse_duration(self.initial, field="backoff.initial")
        object.__setattr__(self, "initial", initial)
        cap = initial if self.max is None and self.factor == 1.0 else self.max
        if cap is None:
            cap = max(initial, timedelta(hours=24))
        object.__setattr__(self, "max", parse_duration(cap, field="backoff.max"))
        if not isinstance(self.factor, int | float) or self.factor < 1:
            raise ConfigError(f"backoff.factor: must be a number >= 1, got {self.factor!r}")
        if not isinstance(self.jitter, int | float) or not 0 <= self.jitter < 1:
            raise ConfigError(f"backoff.jitter: must be a fraction in [0, 1), got {self.jitter!r}")

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
        seconds = min(
            self.initial.total_seconds() * self.factor ** (n - 1), self.max.total_seconds()
        )
        if self.jitter:
            seconds *= 1 + (rng or random).uniform(-self.jitter, self.jitter)
        return timedelta(seconds=seconds)
