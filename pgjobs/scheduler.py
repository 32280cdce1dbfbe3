"""Firing jobs on schedule: the one module that imports APScheduler (3.x).

:class:`Scheduler` gives every enabled job one APScheduler entry (an
interval or a cron trigger) with ``max_instances=1`` and ``coalesce=True``,
and runs each tick through :class:`~pgjobs.Runner`, so that the run
protocol decides what actually happens: another replica may have run the
job already (``not_due``), or hold its group lock (``busy``). A periodic
job that found its group busy is retried once, ``retry_after`` later,
rather than a whole interval later. A periodic entry prunes old run records.

Queue jobs are not paced by their interval, which is only how often they
look when nothing wakes them:

* **drain**: a tick that took items off the queue is followed at once by
  the next (a new transaction: the group lock is let go between batches),
  until one finds nothing;
* **wake on enqueue**: a :class:`~pgjobs.listener.Listener` LISTENs on the
  channels of the queue jobs and fires a job as soon as an enqueue commits;
  wake-ups during a tick make one more tick after it, however many came
  (off behind a transaction pooler, ``$PGJOBS_TRANSACTION_POOLING``);
* **workers**: a job with ``workers = N`` runs up to N ticks at once; a
  worker that claimed a full batch calls the next one in, at once (its
  claim then passes over the entries this one holds).

When the database cannot be reached, one line says so and one line says
when it answers again; the ticks in between are skipped quietly.

The scheduler installs no signal handler and configures no logging; embed
it in a FastAPI app with :func:`lifespan`::

    app = FastAPI(lifespan=pgjobs.lifespan("pgjobs.toml"))

:meth:`Scheduler.shutdown` waits for the running ticks, so a job's
transaction always ends in a commit or a rollback, never half a write.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import zoneinfo
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor as WakePool
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from ._pg import connection_lost, first_line
from .checks import check_jobs
from .database import transaction_pooling
from .durations import Duration, parse_duration
from .errors import ConfigError
from .jobs import Job, Progress, QueueJob
from .listener import Listener
from .locking import DEFAULT_NAMESPACE
from .results import Outcome, RunResult
from .runner import Runner
from .store import DEFAULT_SCHEMA

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from .config import Config
    from .registry import Registry

log = logging.getLogger(__name__)

_PRUNE_ID = "pgjobs:prune"


def _entry_id(name: str) -> str:
    return f"pgjobs:{name}"


def _retry_id(name: str) -> str:
    return f"pgjobs:{name}:busy-retry"


class Scheduler:
    """Runs ``jobs`` on their schedules in background threads.

    ``jobs``: a :class:`~pgjobs.registry.Registry` or job objects (disabled
    jobs are left out). ``database``: a URL, an Engine, or ``None`` for
    ``$PGJOBS_DATABASE_URL``. ``check`` verifies the jobs against the
    database at :meth:`start` (see :func:`pgjobs.checks.check_jobs`), before anything
    is written. ``on_result`` is called with every tick's
    :class:`~pgjobs.RunResult`, from the worker thread. ``listen``: wake queue
    jobs on enqueue (default: yes, unless ``$PGJOBS_TRANSACTION_POOLING`` says
    a transaction pooler is in the way).

    >>> with pgjobs.Scheduler([job], "postgresql://localhost/app"):
    ...     wait_for_shutdown()
    """

    def __init__(
        self,
        jobs: Registry | Iterable[Job],
        database: str | Engine | None = None,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        schema: str = DEFAULT_SCHEMA,
        timezone: str = "UTC",
        keep_runs: Duration | None = "7d",
        prune_every: Duration = "1h",
        max_workers: int = 10,
        check: bool = True,
        on_result: Callable[[RunResult], None] | None = None,
        listen: bool | None = None,
    ) -> None:
        from .registry import Registry

        self.registry = jobs if isinstance(jobs, Registry) else Registry.from_jobs(jobs)
        self.jobs = {job.name: job for job in self.registry.jobs(enabled_only=True)}
        try:
            self.timezone = zoneinfo.ZoneInfo(timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
            raise ConfigError(f"timezone: expected an IANA time zone, got {timezone!r}") from exc
        self.keep_runs = None if keep_runs is None else parse_duration(keep_runs, field="keep_runs")
        self.prune_every = parse_duration(prune_every, field="prune_every")
        if self.prune_every <= timedelta(0):
            raise ConfigError(f"prune_every: must be positive, got {prune_every!r}")
        if not isinstance(max_workers, int) or max_workers < 1:
            raise ConfigError(f"max_workers: expected a positive integer, got {max_workers!r}")
        self.max_workers = max_workers
        self.check = check
        self.on_result = on_result
        self.runner = Runner(database, namespace=namespace, schema=schema)
        self._triggers: dict[str, Any] = {}
        for job in self.jobs.values():
            if job.cron is not None:
                try:
                    self._triggers[job.name] = CronTrigger.from_crontab(
                        job.cron, timezone=self.timezone
                    )
                except ValueError as exc:
                    # The job checked the expression's syntax; what APScheduler
                    # still refuses is named by the job's config key (or plugin).
                    where = self.registry.entry(job.name).key("cron")
                    raise ConfigError(f"{where}: {exc}, got {job.cron!r}") from exc
            else:
                assert job.interval is not None
                self._triggers[job.name] = IntervalTrigger(
                    seconds=job.interval.total_seconds(), timezone=self.timezone
                )
        #: wake queue jobs on enqueue (LISTEN does not work behind a transaction pooler)
        self.listen = (not transaction_pooling()) if listen is None else listen
        # The entries (periodic, busy retry) and the wake-ups all run a job
        # through its slots: one tick at a time per slot, ``workers`` slots.
        self._slots = {
            name: [_Slot() for _ in range(job.workers if isinstance(job, QueueJob) else 1)]
            for name, job in self.jobs.items()
        }
        self._wake_lock = threading.Lock()
        self._pool: WakePool | None = None
        self._outage = _Outage()
        #: the listener, while the scheduler runs and listens
        self.listener: Listener | None = None
        self._lock = threading.Lock()
        self._aps: BackgroundScheduler | None = None
        self._stopping = threading.Event()

    @classmethod
    def from_config(
        cls,
        config: Config | str | os.PathLike[str] | None = None,
        *,
        database: str | Engine | None = None,
        registry: Registry | None = None,
        **options: Any,
    ) -> Scheduler:
        """A scheduler for the jobs of a config file (and the installed plugins).

        ``config``: a :class:`~pgjobs.config.Config`, a path, or ``None`` for
        :func:`~pgjobs.load_config`'s search. ``database`` wins over
        ``$PGJOBS_DATABASE_URL`` and the file's ``database``.
        """
        from .config import Config, load_config
        from .registry import Registry

        if not isinstance(config, Config):
            config = load_config(config)
        if registry is None:
            registry = Registry.load(config)
        url: str | Engine | None = database
        if url is None:
            url = config.database_url()
        settings: dict[str, Any] = {
            "namespace": config.namespace,
            "schema": config.schema,
            "timezone": config.timezone,
            "keep_runs": config.keep_runs,
            "prune_every": config.prune_every,
        }
        settings.update(options)
        return cls(registry, url, **settings)

    # -- lifecycle -------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True between :meth:`start` and :meth:`shutdown`."""
        return self._aps is not None

    def start(self) -> None:
        """Check the jobs, install pgjobs' tables if needed, and start firing.

        Returns at once; the jobs run in background threads. The first tick
        of an interval job is right away (the run protocol skips it if
        another replica ran the job less than an interval ago).
        """
        with self._lock:
            if self._aps is not None:
                return
            if self.check:
                check_jobs(self.runner.engine, [self.registry.entry(n) for n in self.jobs])
            self.runner.install()
            self._stopping.clear()
            aps = BackgroundScheduler(
                timezone=self.timezone,
                executors={"default": ThreadPoolExecutor(self.max_workers)},
                job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": None},
            )
            now = datetime.now(self.timezone)
            for name, job in self.jobs.items():
                first = now if job.interval is not None else None
                options: dict[str, Any] = {"next_run_time": first} if first is not None else {}
                aps.add_job(
                    self._fire,
                    self._triggers[name],
                    args=[name],
                    id=_entry_id(name),
                    name=name,
                    **options,
                )
            if self.keep_runs is not None:
                aps.add_job(
                    self._prune,
                    IntervalTrigger(
                        seconds=self.prune_every.total_seconds(), timezone=self.timezone
                    ),
                    id=_PRUNE_ID,
                    name=_PRUNE_ID,
                )
            with self._wake_lock:
                self._pool = WakePool(self.max_workers, thread_name_prefix="pgjobs-wake")
            aps.start()
            self._aps = aps
            queues = [name for name, job in self.jobs.items() if isinstance(job, QueueJob)]
            if self.listen and queues:
                self.listener = Listener(
                    self.runner.engine,
                    queues,
                    schema=self.runner.store.schema,
                    wake=self.wake,
                    on_lost=_lost_listening,
                    on_back=_listening_again,
                )
                self.listener.start()
            log.info(
                "pgjobs: scheduler started with %d job(s): %s", len(self.jobs), ", ".join(self.jobs)
            )

    def shutdown(self, wait: bool = True) -> None:
        """Stop firing; with ``wait``, return once the running ticks have
        committed or rolled back (nothing is cut in the middle of a write)."""
        with self._lock:
            aps, self._aps = self._aps, None
            self._stopping.set()
            listener, self.listener = self.listener, None
        if listener is not None:
            listener.stop()
        with self._wake_lock:
            pool, self._pool = self._pool, None
        if aps is None:
            self.runner.close()  # start() may have failed after connecting
            return
        if pool is not None:
            pool.shutdown(wait=wait)
        aps.shutdown(wait=wait)
        if wait:
            self.runner.close()
        log.info("pgjobs: scheduler stopped")

    def __enter__(self) -> Scheduler:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    async def __aenter__(self) -> Scheduler:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # shutdown(wait=True) blocks until the running transaction ends: not on the event loop.
        await asyncio.to_thread(self.shutdown)

    # -- what the entries call -----------------------------------------------------
    def run_job(self, name: str) -> RunResult | None:
        """One tick of the job ``name`` now, as its schedule would fire it.

        ``None`` when that job is already running in this process.
        """
        job = self.jobs.get(name)
        if job is None:
            raise ConfigError(
                f"no scheduled job named {name!r} (scheduled: {', '.join(self.jobs) or 'none'})"
            )
        slot = self._slots[name][0]
        if not slot.running.acquire(blocking=False):
            return None
        try:
            return self.runner.tick(job, next_due=self._next_due(job))
        finally:
            slot.running.release()

    def wake(self, name: str) -> None:
        """Run a tick of the queue job ``name`` as soon as a thread is free;
        if it is running, one more tick after the current one (a burst of
        wake-ups makes one tick). What the listener calls on an enqueue."""
        if name in self._slots and not self._stopping.is_set():
            self._call(name, 0)

    def _call(self, name: str, index: int) -> None:
        slot = self._slots[name][index]
        with self._wake_lock:
            slot.again = True
            pool = self._pool
        if pool is None:
            return
        with contextlib.suppress(RuntimeError):  # shut down meanwhile
            pool.submit(self._fire, name, index)

    def _fire(self, name: str, index: int = 0) -> None:
        """The ticks of one worker (``index``) of a job, while there is more."""
        slot = self._slots[name][index]
        while not self._stopping.is_set():
            if not slot.running.acquire(blocking=False):
                return  # the tick running now sees slot.again
            try:
                self._work(name, index, slot)
            finally:
                slot.running.release()
            # a wake-up between the last look and the release: nobody else saw it
            with self._wake_lock:
                if not slot.again:
                    return

    def _work(self, name: str, index: int, slot: _Slot) -> None:
        job = self.jobs[name]
        progress = None
        if index + 1 < len(self._slots[name]):
            assert isinstance(job, QueueJob)

            def progress(phase: str, done: int | None, total: int | None) -> None:
                # A full batch claimed: more is probably due. The next worker is
                # called in now, while this one holds its entries (its claim
                # then passes over them), not after this tick.
                if phase == "claim" and done is not None and done >= job.batch_size:
                    self._call(name, index + 1)

        while not self._stopping.is_set():
            with self._wake_lock:
                slot.again = False
            result = self._tick(job, progress)
            if result is None:
                return
            if index == 0:
                if result.outcome is Outcome.BUSY and result.retry_after is not None:
                    self._retry(name, result.retry_after)
                elif result.outcome is Outcome.NOT_DUE:
                    self._retry_when_due(name, result)
            if self.on_result is not None:
                try:
                    self.on_result(result)
                except Exception:
                    log.exception("pgjobs: on_result failed for %s", name)
            listening = self.listener is not None and self.listener.listening.is_set()
            if not (_more(job, result, listening=listening) or slot.again):
                return

    def _tick(self, job: Job, progress: Progress | None = None) -> RunResult | None:
        try:
            result = self.runner.tick(job, next_due=self._next_due(job), progress=progress)
        except Exception as exc:
            if connection_lost(exc):
                self._outage.down(exc)
            else:
                # The runner records a job's own failures; this is pgjobs unable
                # to use its tables: say so, try at the next tick.
                log.exception("pgjobs: %s: could not run a tick", job.name)
            return None
        if result.outcome is not Outcome.FAILED or result.run_id is not None:
            self._outage.up()
        return result

    def _retry(self, name: str, after: timedelta) -> None:
        with self._lock:
            aps = self._aps
            if aps is None or self._stopping.is_set():
                return
            aps.add_job(
                self._fire,
                "date",
                run_date=datetime.now(self.timezone) + after,
                args=[name],
                id=_retry_id(name),
                name=_retry_id(name),
                replace_existing=True,
            )
        log.debug("pgjobs: %s: trying again in %s", name, after)

    def _retry_when_due(self, name: str, result: RunResult) -> None:
        # A run that started late (a busy retry, a slow tick elsewhere) moves the
        # job's next due time past its next regular tick; without this, that tick
        # finds it "not due" by a hair and the job loses a whole interval.
        job = self.jobs[name]
        if result.next_attempt_at is None or job.interval is None:
            return
        wait = result.next_attempt_at - datetime.now(result.next_attempt_at.tzinfo)
        if timedelta(0) < wait < job.interval:
            self._retry(name, wait + timedelta(milliseconds=10))

    def _next_due(self, job: Job) -> datetime | None:
        if job.cron is None:
            return None
        now = datetime.now(self.timezone)
        due: datetime | None = self._triggers[job.name].get_next_fire_time(now, now)
        return due

    def _prune(self) -> None:
        if self.keep_runs is None or self._stopping.is_set():
            return
        try:
            deleted = self.runner.prune(self.keep_runs)
        except Exception:
            log.exception("pgjobs: could not prune old runs")
            return
        if deleted:
            log.info("pgjobs: pruned %d run record(s) older than %s", deleted, self.keep_runs)


def _lost_listening(exc: BaseException) -> None:
    log.warning(
        "pgjobs: not listening for enqueues (%s); the queue jobs poll until it can again",
        first_line(exc),
    )


def _listening_again() -> None:
    log.warning("pgjobs: listening for enqueues again")


def _claimed(job: Job, result: RunResult) -> tuple[int, int]:
    """(items a queue tick claimed, of which it left queued for later)."""
    if not isinstance(job, QueueJob) or result.outcome is not Outcome.RAN:
        return 0, 0
    return int(result.detail.get("claimed", result.items)), int(result.detail.get("kept", 0))


def _more(job: Job, result: RunResult, *, listening: bool = False) -> bool:
    """Is another tick due at once? After any tick that took items off the
    queue: a partial batch does not mean an empty queue when workers claim
    side by side (two read the same due items, one gets them). The tick
    that finds nothing ends it, for one work check. A lone worker
    (``workers = 1``) that claimed a partial batch while the scheduler is
    listening saw every due item it could take: what is enqueued after its
    claim wakes it again, so it skips that check (a trickle's every item
    paid a second tick for it)."""
    claimed, kept = _claimed(job, result)
    if claimed <= kept:
        return False
    partial = isinstance(job, QueueJob) and job.workers == 1 and claimed < job.batch_size
    return not (listening and partial)


class _Slot:
    """One worker of a job: one tick at a time; ``again`` asks it for one more."""

    __slots__ = ("again", "running")

    def __init__(self) -> None:
        self.running = threading.Lock()
        self.again = False


class _Outage:
    """One line when the database stops answering, one when it is back:
    the ticks in between are skipped without a word each."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None

    def down(self, exc: BaseException) -> None:
        with self._lock:
            if self._since is not None:
                return
            self._since = time.monotonic()
        log.warning(
            "pgjobs: the database is unreachable (%s); the jobs wait for it, trying again"
            " at their next tick",
            first_line(exc),
        )
        log.debug("pgjobs: the error", exc_info=exc)

    def up(self) -> None:
        if self._since is None:
            return
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            log.warning(
                "pgjobs: the database answers again, after %.1f s", time.monotonic() - since
            )


class Lifespan:
    """An async context manager that starts a :class:`Scheduler` and shuts
    it down; also callable with an app, as FastAPI's ``lifespan=`` wants.

    It yields ``{"pgjobs": scheduler}``: Starlette puts that in the lifespan
    state, so request handlers find the scheduler as ``request.state.pgjobs``.
    """

    def __init__(
        self, target: Scheduler | Config | str | os.PathLike[str] | None, options: dict[str, Any]
    ) -> None:
        self._target = target
        self._options = options
        self.scheduler: Scheduler | None = None

    def __call__(self, app: object) -> Lifespan:
        return self

    async def __aenter__(self) -> dict[str, Scheduler]:
        if isinstance(self._target, Scheduler):
            scheduler = self._target
        else:
            scheduler = await asyncio.to_thread(
                Scheduler.from_config, self._target, **self._options
            )
        await scheduler.__aenter__()
        self.scheduler = scheduler
        return {"pgjobs": scheduler}

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        scheduler, self.scheduler = self.scheduler, None
        if scheduler is not None:
            await scheduler.__aexit__(exc_type, exc, tb)


def lifespan(
    scheduler_or_config: Scheduler | Config | str | os.PathLike[str] | None = None, **options: Any
) -> Lifespan:
    """A FastAPI/Starlette lifespan that runs pgjobs' scheduler with the app::

        app = FastAPI(lifespan=pgjobs.lifespan("pgjobs.toml"))
        # or: async with pgjobs.lifespan(scheduler): ...

    ``scheduler_or_config``: a :class:`Scheduler`, or what
    :meth:`Scheduler.from_config` takes (``options`` go to it). Installs no
    signal handler; shutdown waits for the running transaction, off the event loop.
    """
    return Lifespan(scheduler_or_config, options)


__all__ = ["Lifespan", "Scheduler", "lifespan"]
