"""The exceptions pgjobs raises.

::

    PgJobsError            anything pgjobs raises on purpose
     ├── ConfigError       a job, option or config file is wrong (names the field/key)
     ├── PluginError       a plugin could not be loaded or registered something invalid
     ├── JobError          a job's run failed (chained to the database or plugin cause)
 │    └── ScopeError   a compute restricted to some keys would still compute every key
     ├── SchemaError       pgjobs' schema does not fit this code (newer, or not migrated)
     └── MigrationError    a migration could not be applied (a lock not granted in time)

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


class ScopeError(JobError):
    """A compute restricted to some keys of its scope (a slice, a list of
    keys) would still compute every key: the restriction does not reach the
    rows in its plan (:func:`pgjobs.scoping.check_plan`)."""


class SchemaError(PgJobsError):
    """pgjobs' schema in the database does not fit this code: it is past a
    breaking migration of newer code, or migrations are pending and
    automatic migration is off."""


class MigrationError(PgJobsError):
    """A migration could not be applied (its locks were not granted in time;
    a migration file without its ``-- pgjobs-migration:`` line)."""


__all__ = [
    "ConfigError",
    "JobError",
    "MigrationError",
    "PgJobsError",
    "PluginError",
    "SchemaError",
    "ScopeError",
]
