"""pgjobs: PostgreSQL background jobs that rewrite derived data safely.

Every public name is re-exported here; everything else is implementation.
"""

from __future__ import annotations

from .backoff import Backoff
from .durations import parse_duration
from .errors import ConfigError, JobError, PgJobsError, PluginError
from .jobs import Job, Parent, QueueJob, RecomputeJob, TaskJob
from .results import DiffStats, Outcome, RunResult
from .runner import RunContext, Runner, run_once

__all__ = [
    "Backoff",
    "ConfigError",
    "DiffStats",
    "Job",
    "JobError",
    "Outcome",
    "Parent",
    "PgJobsError",
    "PluginError",
    "QueueJob",
    "RecomputeJob",
    "RunContext",
    "RunResult",
    "Runner",
    "TaskJob",
    "parse_duration",
    "run_once",
]
