"""pgjobs: PostgreSQL background jobs that rewrite derived data safely.

Every public name is re-exported here; everything else is implementation.
"""

from __future__ import annotations

from .api import check, install, run_once
from .backoff import Backoff
from .config import Config, load_config
from .drift import CheckResult, Sample
from .durations import parse_duration
from .errors import (
    ConfigError,
    JobError,
    MigrationError,
    PgJobsError,
    PluginError,
    SchemaError,
    ScopeError,
)
from .hookspecs import hookimpl
from .jobs import Job, Locks, Parent, QueueJob, RecomputeJob, RunContext, TaskJob
from .lifecycle import lifespan
from .queue import (
    QueueStats,
    drop_enqueue_trigger,
    drop_enqueue_trigger_async,
    enqueue,
    enqueue_async,
    install_enqueue_trigger,
    install_enqueue_trigger_async,
    queue_stats,
    queue_stats_async,
)
from .registry import Registry, get_registry
from .results import DiffStats, Outcome, RunResult
from .runner import Runner
from .scheduler import Scheduler

__all__ = [
    "Backoff",
    "CheckResult",
    "Config",
    "ConfigError",
    "DiffStats",
    "Job",
    "JobError",
    "Locks",
    "MigrationError",
    "Outcome",
    "Parent",
    "PgJobsError",
    "PluginError",
    "QueueJob",
    "QueueStats",
    "RecomputeJob",
    "Registry",
    "RunContext",
    "RunResult",
    "Runner",
    "Sample",
    "Scheduler",
    "SchemaError",
    "ScopeError",
    "TaskJob",
    "check",
    "drop_enqueue_trigger",
    "drop_enqueue_trigger_async",
    "enqueue",
    "enqueue_async",
    "get_registry",
    "hookimpl",
    "install",
    "install_enqueue_trigger",
    "install_enqueue_trigger_async",
    "lifespan",
    "load_config",
    "parse_duration",
    "queue_stats",
    "queue_stats_async",
    "run_once",
]
