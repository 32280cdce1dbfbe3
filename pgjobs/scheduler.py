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
it in a FastAPI app with :func:`~pgjobs.lifespan` (:mod:`pgjobs.lifecycle`)::

    app = FastAPI(lifespan=pgjobs.lifespan("pgjobs.toml"))

:meth:`Scheduler.shutdown` waits for the running ticks, so a job's
transaction always ends in a commit or a rollback, never half a write; with
a deadline (``shutdown(timeout=...)``, ``shutdown_timeout``), the ticks
still running when it passes have their statements cancelled on the server
and roll back, recorded ``cancelled`` (no failure, no backoff).

A job that fails its pre-flight check at :meth:`Scheduler.start` is set
aside, failing and backed off, while the others run (:mod:`pgjobs.preflight`);
``strict=True`` refuses to start instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import zoneinfo
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor as WakePool
from datetime import datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from ._pg import first_line, unavailable
from .checks import check_jobs
from .database import transaction_pooling
from .deadline import DEFAULT_CALL_TIMEOUT
from .derived import check_declared, install_triggers
from .derived.declare import upstream_of
from .durations import Duration, format_duration, parse_duration
from .errors import ConfigError
from .firing import (
    CANCEL_GRACE,
    InFlight,
    Outage,
    Slot,
    deadline_of,
    listening_again,
    lost_listening,
    more_at_once,
)
from .flow import RENEW_EVERY, renew
from .heartbeat import Heartbeat
from .horizon import HORIZON_WARNING, HorizonWatch
from .jobs import Job, Progress, QueueJob, RecomputeJob
from .listener import Listener
from .locking import (
    DEFAULT_NAMESPACE,
    release_session_lock,
    try_session_lock,
    verify_lock_name,
)
from .preflight import Preflight
from .results import Outcome, RunResult
from .runner import Runner
from .store import DEFAULT_SCHEMA

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from .config import Config
    from .registry import Registry

log = logging.getLogger(__name__)

_PRUNE_ID = "pgjobs:prune"
_RENEW_ID = "pgjobs:flow-workers"


#: outcomes retried ``retry_after`` later by whichever worker had them
_SOON = (Outcome.INTERRUPTED, Outcome.TRANSIENT, Outcome.RAN, Outcome.IDLE)


def _entry_id(name: str) -> str:
    return f"pgjobs:{name}"


def _retry_id(name: str) -> str:
    return f"pgjobs:{name}:busy-retry"


def _verify_id(name: str) -> str:
    return f"pgjobs:{name}:verify"


class Scheduler:
    """Runs ``jobs`` on their schedules in background threads.

    ``jobs``: a :class:`~pgjobs.registry.Registry` or job objects (disabled
    jobs are left out). ``database``: a URL, an Engine, or ``None`` for
    ``$PGJOBS_DATABASE_URL``. ``check`` verifies the jobs against the
    database at :meth:`start` (see :func:`pgjobs.checks.check_jobs`): a job
    that fails is reported, shown failing and backed off, and checked again
    when its backoff ends, while the other jobs run; with ``strict``, one
    that fails makes :meth:`start` raise, before anything is written.
    ``shutdown_timeout``: the default deadline of :meth:`shutdown` (``None``:
    wait as long as the running ticks take). ``heartbeat_every``: how often
    the scheduler records that it is alive (:mod:`pgjobs.heartbeat`), and
    reads the database's xmin horizon with each beat: one held longer than
    ``horizon_warning`` is logged once when it starts and once when it ends
    (:mod:`pgjobs.horizon`).
    ``on_result`` is called with every tick's :class:`~pgjobs.RunResult`,
    from the worker thread. ``listen``: wake queue jobs on enqueue (default:
    yes, unless ``$PGJOBS_TRANSACTION_POOLING`` says a transaction pooler is
    in the way). ``auto_migrate`` false: :meth:`start` refuses
    (:class:`~pgjobs.SchemaError`) while migrations are pending, instead of
    applying them (``pgjobs migrate`` does).

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
        strict: bool = False,
        shutdown_timeout: Duration | None = None,
        heartbeat_every: Duration = "5s",
        auto_migrate: bool = True,
        call_timeout: Duration = DEFAULT_CALL_TIMEOUT,
        horizon_warning: Duration = HORIZON_WARNING,
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
        self.strict = strict
        self.shutdown_timeout = deadline_of(shutdown_timeout, "shutdown_timeout")
        self.on_result = on_result
        self.runner = Runner(
            database,
            namespace=namespace,
            schema=schema,
            auto_migrate=auto_migrate,
            call_timeout=call_timeout,
        )
        #: the jobs that failed their pre-flight check, set aside
        self.preflight = Preflight(self.runner)
        self._flight = InFlight()
        #: this scheduler's row in pgjobs.scheduler, while it runs
        #: a snapshot held longer is logged, and shown on the page (pgjobs.horizon)
        self.horizon_warning = parse_duration(horizon_warning, field="horizon_warning")
        if self.horizon_warning <= timedelta(0):
            raise ConfigError(f"horizon_warning: must be positive, got {horizon_warning!r}")
        self.heartbeat = Heartbeat(
            self.runner.connect,
            schema,
            list(self.jobs),
            heartbeat_every,
            watch=HorizonWatch(self.horizon_warning),
        )
        self._triggers = self._make_triggers()
        #: wake queue jobs on enqueue (LISTEN does not work behind a transaction pooler)
        self.listen = (not transaction_pooling()) if listen is None else listen
        # The entries (periodic, busy retry) and the wake-ups all run a job
        # through its slots: one tick at a time per slot, ``workers`` slots.
        self._slots = {
            name: [Slot() for _ in range(job.workers if isinstance(job, QueueJob) else 1)]
            for name, job in self.jobs.items()
        }
        self._wake_lock = threading.Lock()
        self._pool: WakePool | None = None
        self._outage = Outage()
        #: chains of derived tables: the recomputes to run right after each
        #: tick of a recompute (those of the tables that read its table), and
        #: the recomputes each one waits for
        self._after, self._before = self._chain_links()
        #: the listener, while the scheduler runs and listens
        self.listener: Listener | None = None
        self._lock = threading.Lock()
        self._aps: BackgroundScheduler | None = None
        self._stopping = threading.Event()

    def _chain_links(self) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
        """A chain of derived tables recomputes in dependency order: a
        derived table's recompute runs right after each tick of the
        recomputes of the tables it reads (its own schedule still decides
        whether it is due), never at the same time as one of them, and its
        first tick waits for theirs."""
        after: dict[str, list[str]] = {}
        before: dict[str, list[str]] = {}
        declared = self.registry.derived()
        for derived in declared:
            for upstream in upstream_of(derived, declared):
                if derived.name in self.jobs and upstream.name in self.jobs:
                    after.setdefault(upstream.name, []).append(derived.name)
                    before.setdefault(derived.name, []).append(upstream.name)
        return after, before

    def _make_triggers(self) -> dict[str, Any]:
        """Each job's APScheduler trigger: its cron (in its time zone, else
        the scheduler's) or its interval."""
        triggers: dict[str, Any] = {}
        for job in self.jobs.values():
            if job.cron is not None:
                try:
                    zone = (
                        self.timezone if job.timezone is None else zoneinfo.ZoneInfo(job.timezone)
                    )
                    triggers[job.name] = CronTrigger.from_crontab(job.cron, timezone=zone)
                except ValueError as exc:
                    # The job checked the expression's syntax; what APScheduler
                    # still refuses is named by the job's config key (or plugin).
                    where = self.registry.entry(job.name).key("cron")
                    raise ConfigError(f"{where}: {exc}, got {job.cron!r}") from exc
            else:
                assert job.interval is not None
                triggers[job.name] = IntervalTrigger(
                    seconds=job.interval.total_seconds(), timezone=self.timezone
                )
        return triggers

    @classmethod
    def from_config(
        cls,
        config: Config | str | os.PathLike[str] | None = None,
        *,
        database: str | Engine | None = None,
        registry: Registry | None = None,
        entry_points: Iterable[str] | None = None,
        **options: Any,
    ) -> Scheduler:
        """A scheduler for the jobs of a config file (and the installed plugins).

        ``config``: a :class:`~pgjobs.config.Config`, a path, or ``None`` for
        :func:`~pgjobs.load_config`'s search. ``database`` wins over
        ``$PGJOBS_DATABASE_URL`` and the file's ``database``. ``entry_points``:
        the installed plugins to load, by entry-point or distribution name
        (``[]``: none); it wins over ``$PGJOBS_LOAD_PLUGINS`` and the file's
        ``entry_points`` (``None``: as they say; neither set: all).
        """
        from .config import Config, load_config
        from .registry import Registry

        if not isinstance(config, Config):
            config = load_config(config)
        if registry is None:
            registry = Registry.load(
                config, entry_points=True if entry_points is None else entry_points
            )
        elif entry_points is not None:
            raise ConfigError("give a registry or entry_points, not both")
        url: str | Engine | None = database
        if url is None:
            url = config.database_url()
        settings: dict[str, Any] = {
            "namespace": config.namespace,
            "schema": config.schema,
            "timezone": config.timezone,
            "keep_runs": config.keep_runs,
            "prune_every": config.prune_every,
            "heartbeat_every": config.heartbeat_every,
            "shutdown_timeout": config.shutdown_timeout,
            "auto_migrate": config.auto_migrate,
            "call_timeout": config.call_timeout,
            "horizon_warning": config.horizon_warning,
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
            if self.check and self.strict:
                check_jobs(
                    self.runner.engine,
                    [self.registry.entry(n) for n in self.jobs],
                    schema=self.runner.store.schema,
                )
            self.runner.install()
            if self.runner.store.auto_migrate:
                self._install_derived()
            if self.check and not self.strict:
                self.preflight.check(self.registry.entry(n) for n in self.jobs)
            self.heartbeat.start()
            try:
                self._stopping.clear()
                self._renew_workers()
                aps = BackgroundScheduler(
                    timezone=self.timezone,
                    executors={"default": ThreadPoolExecutor(self.max_workers)},
                    job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": None},
                )
                self._add_entries(aps)
                with self._wake_lock:
                    self._pool = WakePool(self.max_workers, thread_name_prefix="pgjobs-wake")
                aps.start()
                self._aps = aps
                self._start_listener()
            except BaseException:
                self.heartbeat.stop()  # a scheduler that did not start does not say it lives
                raise
            log.info(
                "pgjobs: scheduler started with %d job(s): %s", len(self.jobs), ", ".join(self.jobs)
            )

    def _install_derived(self) -> None:
        """With ``auto_migrate`` (as pgjobs' own schema at start), the
        triggers of the derived tables this scheduler runs, made to agree
        with their declarations as ``pgjobs migrate`` does; each declaration
        checked first, one that fails left without triggers (its jobs are
        set aside by their pre-flight check) and logged. Triggers of other
        declarations are left alone (another process may run them)."""
        declared = [d for d in self.registry.derived() if d.name in self.jobs]
        if not declared:
            return
        fine = []
        with self.runner.engine.connect() as conn:
            for derived in declared:
                try:
                    check_declared(conn, [derived])
                except ConfigError as exc:
                    log.warning("pgjobs: %s: its triggers are not installed", exc)
                    continue
                fine.append(derived)
            done = install_triggers(conn, fine, self.runner.store.schema, check=False, drop=False)
        if done.statements:
            log.info("pgjobs: derived tables' triggers made to agree: %s", "; ".join(done.lines()))

    def _add_entries(self, aps: BackgroundScheduler) -> None:
        """The APScheduler entries: each job's (an interval job's first tick
        now), the verifications, the prune, the workers' records."""
        now = datetime.now(self.timezone)
        for name, job in self.jobs.items():
            # a derived table's recompute that reads another's ticks first after it
            first = now if job.interval is not None and name not in self._before else None
            options: dict[str, Any] = {"next_run_time": first} if first is not None else {}
            aps.add_job(
                self._fire,
                self._triggers[name],
                args=[name],
                id=_entry_id(name),
                name=name,
                **options,
            )
        for name, job in self.jobs.items():
            verify = job.verify_interval if isinstance(job, RecomputeJob) else None
            if verify is not None:
                # (the first check one interval after the start: the job's
                # own first run comes first)
                aps.add_job(
                    self._verify,
                    IntervalTrigger(seconds=verify.total_seconds(), timezone=self.timezone),
                    args=[name],
                    id=_verify_id(name),
                    name=_verify_id(name),
                )
        if self.keep_runs is not None:
            aps.add_job(
                self._prune,
                IntervalTrigger(seconds=self.prune_every.total_seconds(), timezone=self.timezone),
                id=_PRUNE_ID,
                name=_PRUNE_ID,
            )
        if any(isinstance(job, QueueJob) for job in self.jobs.values()):
            aps.add_job(  # their records, for recomputes elsewhere (pgjobs.flow)
                self._renew_workers,
                IntervalTrigger(seconds=RENEW_EVERY.total_seconds(), timezone=self.timezone),
                id=_RENEW_ID,
                name=_RENEW_ID,
            )

    def _start_listener(self) -> None:
        """LISTEN for the queue jobs' enqueues, if asked to and there are any."""
        queues = [name for name, job in self.jobs.items() if isinstance(job, QueueJob)]
        if self.listen and queues:
            self.listener = Listener(
                self.runner.engine,
                queues,
                schema=self.runner.store.schema,
                wake=self.wake,
                on_lost=lost_listening,
                on_back=listening_again,
                check_timeout=self.runner.call_timeout,
            )
            self.listener.start()

    def shutdown(self, wait: bool = True, *, timeout: Duration | None = None) -> bool:
        """Stop firing; with ``wait``, return once the running ticks have
        committed or rolled back (nothing is cut in the middle of a write).

        ``timeout`` (default: the scheduler's ``shutdown_timeout``): wait at
        most that long; then cancel the statements of the ticks still
        running, on the server, and wait for their rollback (at most
        :data:`CANCEL_GRACE` more). They are recorded ``cancelled``: not a
        failure, no backoff. Returns False when a tick is still running after
        that (one busy in Python rather than in a statement: it is left to
        its thread; a process that exits now has PostgreSQL roll it back).
        """
        deadline = self.shutdown_timeout if timeout is None else deadline_of(timeout, "timeout")
        if wait and deadline is not None:
            return self._shutdown_by(deadline)
        aps, pool = self._stop_firing()
        if aps is None:
            self.runner.close()  # start() may have failed after connecting
            return True
        if pool is not None:
            pool.shutdown(wait=wait)
        aps.shutdown(wait=wait)
        self.heartbeat.stop()  # after the ticks: a stopping scheduler is still alive
        if wait:
            self.runner.close()
        log.info("pgjobs: scheduler stopped")
        return True

    def _stop_firing(self) -> tuple[BackgroundScheduler | None, WakePool | None]:
        """Stop the entries, the listener and the wake-ups; what is left to shut down."""
        with self._lock:
            aps, self._aps = self._aps, None
            self._stopping.set()
            listener, self.listener = self.listener, None
        if listener is not None:
            listener.stop()
        with self._wake_lock:
            pool, self._pool = self._pool, None
        return aps, pool

    def _shutdown_by(self, deadline: timedelta) -> bool:
        """:meth:`shutdown` with a deadline: the running ticks are waited for
        through :class:`InFlight`, not the executors (which cannot time out)."""
        aps, pool = self._stop_firing()
        if aps is None:
            self.runner.close()  # start() may have failed after connecting
            return True
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        aps.shutdown(wait=False)
        done = self._flight.wait(deadline.total_seconds())
        names: list[str] = []
        if not done:
            # the cancels too end within the grace (a server that cannot be
            # reached does not hold the shutdown past it)
            end = time.monotonic() + CANCEL_GRACE
            names = self.runner.cancel_running(timeout=CANCEL_GRACE)
            log.warning(
                "pgjobs: shutdown deadline (%s) passed; cancelling the running tick(s) of %s",
                format_duration(deadline),
                ", ".join(names) or "no job (between two ticks)",
            )
            # a tick between two statements missed the cancel: ask again
            while not done and time.monotonic() < end:
                done = self._flight.wait(min(0.1, max(0.0, end - time.monotonic())))
                left = end - time.monotonic()
                if not done and left > 0:
                    names = self.runner.cancel_running(timeout=left)
        self.heartbeat.stop(delete=done)
        if done:
            self.runner.close()
            log.info("pgjobs: scheduler stopped")
        else:
            log.warning(
                "pgjobs: scheduler stopped with tick(s) still running in %s (not in a statement"
                " that could be cancelled); they end with the process",
                ", ".join(names) or "their threads",
            )
        return done

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
        with self._flight:
            while not self._stopping.is_set():
                if not slot.running.acquire(blocking=False):
                    return  # the tick running now sees slot.again
                try:
                    self._work(name, index, slot)
                finally:
                    slot.running.release()
                # (after the release: the recomputes that read this one's
                # table wait while it runs)
                for downstream in self._after.get(name, ()):
                    self._call(downstream, 0)
                # a wake-up between the last look and the release: nobody else saw it
                with self._wake_lock:
                    if not slot.again:
                        return

    def _work(self, name: str, index: int, slot: Slot) -> None:
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

        woken = False  # the first tick: called by a wake-up (again), or by its entry
        while not self._stopping.is_set():
            with self._wake_lock:
                woken, slot.again = woken or slot.again, False
            if any(self._slots[u][0].running.locked() for u in self._before.get(name, ())):
                return  # a recompute it reads is running: that one calls it when done
            result = self._tick(job, progress, woken=woken)
            if result is None:
                return
            if result.outcome in _SOON and result.retry_after is not None:
                # interrupted, transient: within seconds; ran, idle: items
                # left for a lock someone holds (docs/DESIGN.md, "Transient
                # failures", "Locks someone holds")
                self._retry(name, result.retry_after)
            elif index == 0:
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
            if not (more_at_once(job, result, listening=listening) or slot.again):
                return
            woken = True  # the next tick follows one that took items, or a wake-up

    def _tick(
        self, job: Job, progress: Progress | None = None, *, woken: bool = False
    ) -> RunResult | None:
        try:
            if not self.preflight.ready(job):
                return None  # set aside: failing its pre-flight check, backed off
            result = self.runner.tick(
                job, next_due=self._next_due(job), progress=progress, woken=woken
            )
        except Exception as exc:
            if unavailable(exc):
                # a tick that could not start: the database is away (or read-only,
                # a standby); tried again soon, without a word each time
                self._outage.down(exc)
                delay = self.runner.interruptions.note(job.name, first_line(exc), quiet=True)
                self._retry(job.name, timedelta(seconds=delay))
            else:
                # The runner records a job's own failures; this is pgjobs unable
                # to use its tables: say so, try at the next tick.
                log.exception("pgjobs: %s: could not run a tick", job.name)
            return None
        if result.outcome is not Outcome.INTERRUPTED and (
            result.outcome is not Outcome.FAILED or result.run_id is not None
        ):
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

    def _verify(self, name: str) -> None:
        """A scheduled verification (``verify_every``): :func:`pgjobs.drift.verify`."""
        job = self.jobs[name]
        if self._stopping.is_set() or not isinstance(job, RecomputeJob):
            return
        from .drift import verify, workers_of

        try:
            with self._verifying(job) as turn:
                if not turn:
                    log.debug("pgjobs: %s: another scheduler checks its group now", name)
                    return
                result = verify(
                    self.runner.engine,
                    self.runner.store,
                    job,
                    workers=workers_of(job, self.registry.jobs()),
                    worker=self.runner.worker,
                    call_timeout=self.runner.call_timeout,
                )
        except Exception as exc:
            log.warning("pgjobs: %s: could not check: %s", name, first_line(exc))
            return
        if result is not None and self.on_result is not None:
            try:
                self.on_result(result)
            except Exception:
                log.exception("pgjobs: on_result failed for %s", name)

    @contextlib.contextmanager
    def _verifying(self, job: Job) -> Iterator[bool]:
        """The group's verification lock (:func:`pgjobs.locking.verify_lock_name`),
        tried, held at session level on a connection of its own while the
        block runs: True when this scheduler has it. Replicas whose
        ``verify_every`` fire together would each run the full check (the
        last-check test in :func:`pgjobs.drift.verify` reads before either
        records); with the lock one checks, and one that comes after it
        finds that check recorded."""
        name = verify_lock_name(self.runner.namespace, job.group or job.name)
        with self.runner.connect() as conn:
            with conn.begin():
                turn = try_session_lock(conn, name) is not None
            try:
                yield turn
            finally:
                if turn:
                    try:
                        with conn.begin():
                            release_session_lock(conn, name)
                    except Exception:
                        # a pooled connection must not go back holding the lock
                        conn.invalidate()

    def _prune(self) -> None:
        if self.keep_runs is None or self._stopping.is_set():
            return
        try:
            with self._flight:
                deleted = self.runner.prune(self.keep_runs)
        except Exception:
            log.exception("pgjobs: could not prune old runs")
            return
        if deleted:
            log.info("pgjobs: pruned %d run record(s) older than %s", deleted, self.keep_runs)

    def _renew_workers(self) -> None:
        """Record the queue jobs as workers of their targets, for recomputes
        that run in other processes (:mod:`pgjobs.flow`). A failure is only
        logged: the ticks record their job too."""
        queues = [job for job in self.jobs.values() if isinstance(job, QueueJob)]
        if not queues or self._stopping.is_set():
            return
        try:
            with self.runner.connect() as conn:
                renew(conn, queues, self.runner.namespace, self.runner.store.schema)
        except Exception:
            log.debug("pgjobs: could not record the queue workers", exc_info=True)


__all__ = ["Scheduler"]
