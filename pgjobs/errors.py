"""The exceptions pgjobs raises.

::

    PgJobsError            anything pgjobs raises on purpose
     ├── ConfigError       a job, option or config file is wrong (names the field/key)
     ├── PluginError       a plugin could not be loaded or registered something invalid
     └── JobError          a job's run failed (chained to the database or plugin cause)

A group lock found busy is an *outcome* (``RunResult.outcome == "busy"``),
never an exception.
"""

from __future__ import annotations


class PgJobsError(Exception):
    """pgjobs failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigError(PgJobsError, ValueError):
    """A job definition, option or configuration file is invalid."""


class PluginError(PgJobsError):
    """A plugin could not be loaded, or registered something invalid."""


class JobError(PgJobsError):
    """A job's run failed."""

    def __init__(self, message: str | None = None, *, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
