"""What the operator's commands do: ``pgjobs pause``, ``resume``,
``enqueue`` and ``revive`` (the CLI only parses and prints; docs/operate.md).

* A pause is two columns of the job's ``job_state`` row (migration 011):
  the runner reads them in the statement it sends anyway at step 1, so
  every scheduler on the database honours a pause from its next tick, at no
  cost. A paused tick ends ``paused``: counted, not logged. Enqueues go on;
  the items wait. A resume wakes the job's schedulers (the channel an
  enqueue notifies), so that a queue job drains at once.
* ``enqueue`` is :func:`pgjobs.enqueue` in one transaction; keys typed on
  the command line are converted as the application's would be (an integer
  scope column takes JSON numbers, as Python's ``int`` keys give), so that
  an item enqueued from the shell and one from the code are the same item.
* ``revive`` puts dead (parked) items back: due now, attempts reset.

Each function takes an Engine and does its work in one transaction.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from psycopg import sql
from sqlalchemy.engine import Connection, Engine

from ._pg import execute, send, set_local
from .config import Config
from .database import engine_for
from .deadline import bound_of
from .durations import format_duration, setting_ms
from .errors import ConfigError
from .jobs import Job, QueueJob
from .queue import channel, enqueue, key_json
from .registry import Registry
from .results import RunResult
from .store import Store


@contextlib.contextmanager
def _transaction(engine: Engine, store: Store) -> Iterator[Connection]:
    """A connection in a transaction (pgjobs' schema checked first) whose
    statements stop on the server within the connection's round-trip bound
    (the config's ``call_timeout``): a lock another session holds is not
    waited for past it, by the server either."""
    with engine.connect() as conn:
        store.ensure(conn)
        with conn.begin():
            seconds = bound_of(conn)
            if seconds:
                send(conn, set_local({"statement_timeout": setting_ms(seconds)}))
            yield conn


@dataclass(frozen=True, slots=True)
class Pause:
    """A job's pause, as ``job_state`` holds it."""

    job: str
    since: datetime
    reason: str | None
    by: str | None


def who() -> str:
    """Who pauses: ``user@host``, for the record."""
    try:
        user = getpass.getuser()
    except Exception:  # no user name in the environment (a container)
        user = "?"
    return f"{user}@{socket.gethostname()}"


def _state(store: Store) -> sql.Identifier:
    return store.table("job_state")


def pause(engine: Engine, store: Store, job: Job, *, reason: str | None) -> tuple[Pause, bool]:
    """Pause ``job`` on every scheduler of the database; returns the pause
    and whether it is new (a job paused already keeps its ``since`` and
    takes the new reason)."""
    with _transaction(engine, store) as conn:
        before = _read_pause(conn, store, job.name, lock=True)
        row = execute(
            conn,
            sql.SQL(
                "insert into {} as s (job, paused_at, paused_reason, paused_by)"
                " values (%s, now(), %s, %s) on conflict (job) do update set"
                " paused_at = coalesce(s.paused_at, excluded.paused_at),"
                " paused_reason = excluded.paused_reason, paused_by = excluded.paused_by"
                " returning paused_at, paused_reason, paused_by"
            ).format(_state(store)),
            (job.name, reason, who()),
        ).fetchone()
    assert row is not None
    return Pause(job.name, row[0], row[1], row[2]), before is None


def resume(engine: Engine, store: Store, job: Job) -> Pause | None:
    """Resume ``job``; the pause it ended (``None``: it was not paused). A
    queue job's schedulers are woken to drain what accumulated."""
    with _transaction(engine, store) as conn:
        before = _read_pause(conn, store, job.name, lock=True)
        if before is None:
            return None
        execute(
            conn,
            sql.SQL(
                "update {} set paused_at = null, paused_reason = null, paused_by = null"
                " where job = %s"
            ).format(_state(store)),
            (job.name,),
        )
        if isinstance(job, QueueJob):
            execute(conn, "select pg_notify(%s, '')", (channel(store.schema, job.name),))
    return before


def _read_pause(conn: Connection, store: Store, job: str, *, lock: bool) -> Pause | None:
    row = execute(
        conn,
        sql.SQL("select paused_at, paused_reason, paused_by from {} where job = %s{}").format(
            _state(store), sql.SQL(" for update" if lock else "")
        ),
        (job,),
    ).fetchone()
    if row is None or row[0] is None:
        return None
    return Pause(job, row[0], row[1], row[2])


def paused_of(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """A ``job_state`` row's pause, as ``pgjobs status --json`` shows it."""
    if state.get("paused_at") is None:
        return None
    return {
        "since": state["paused_at"],
        "reason": state.get("paused_reason"),
        "by": state.get("paused_by"),
    }


def last_check_of(run: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A job's last check (its last ``checked`` run), as ``pgjobs status
    --json`` shows it: when, the drift found (rows a recompute would write
    then, or skip), and the error when the check failed."""
    if not run:
        return None
    return {
        "at": run.get("finished_at") or run.get("started_at"),
        "drift": {k: run.get(k) or 0 for k in ("inserted", "updated", "deleted")},
        "skipped_missing_parent": run.get("skipped_missing_parent") or 0,
        "error": run.get("error"),
    }


def check_line(check: Mapping[str, Any], now: datetime) -> str:
    """What ``pgjobs status`` says of a job's last check."""
    at = check["at"]
    age = timedelta(seconds=int(max(now - at, timedelta(0)).total_seconds())) if at else None
    when = "" if age is None else f" {format_duration(age)} ago"
    if check["error"]:
        return f"last check failed{when}: {check['error']}"
    drift = check["drift"]
    total = sum(drift.values())
    if not total:
        return f"last checked{when}: no drift"
    return (
        f"last checked{when}: {total:,} rows drift (+{drift['inserted']:,}"
        f" ~{drift['updated']:,} -{drift['deleted']:,})"
    )


def paused_line(result: RunResult) -> str:
    """What ``pgjobs once`` says of a paused job."""
    since = result.detail.get("paused_at")
    reason = result.detail.get("reason")
    when = f" since {since:%Y-%m-%d %H:%M:%S %Z}" if isinstance(since, datetime) else ""
    why = f" ({reason})" if reason else ""
    return (
        f"{result.job}: paused{when}{why}; not run (pgjobs resume {result.job} resumes it,"
        " --force runs this tick anyway)"
    )


def schedulers_table(schedulers: Sequence[Mapping[str, Any]], now: datetime) -> str:
    """The schedulers' part of ``pgjobs status``."""

    def ago(when: datetime) -> str:
        return (
            f"{format_duration(timedelta(seconds=max(0, int((now - when).total_seconds()))))} ago"
        )

    rows = [
        [
            f"{s['host']}:{s['pid']}",
            str(s["version"]),
            ago(s["started_at"]),
            ago(s["last_seen"]),
            "live" if s["live"] else "gone quiet",
            ", ".join(s["jobs"]),
        ]
        for s in schedulers
    ]
    headers = ["SCHEDULER", "VERSION", "STARTED", "LAST SEEN", "STATE", "JOBS"]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
        for line in [headers, *rows]
    )


# -- the queue -----------------------------------------------------------------------
def queue_job(job: Job) -> QueueJob:
    """``job``, if its items are in pgjobs' queue; else a ConfigError saying why not."""
    if not isinstance(job, QueueJob):
        raise ConfigError(f"{job.name}: a {job.kind} job has no queue (only queue jobs do)")
    if getattr(job, "claim", None) is not None:
        raise ConfigError(
            f"{job.name}: it claims its items from a queue of its own (claim=...), not pgjobs'"
        )
    return job


def parse_keys(
    conn: Connection, job: QueueJob, texts: Sequence[str], *, as_json: bool
) -> list[Any]:
    """The keys given on the command line, as the queue stores them. Text
    for a one-column scope: converted by the scope column's type (integers
    and floats become numbers, booleans true/false, the rest stays text, as
    the application's Python values would). ``as_json``: each is a JSON
    array of the scope's values in its order (a scalar for one column), or
    an object by column name."""
    width = len(job.scope)
    if as_json:
        return [_json_key(job, text) for text in texts]
    if width != 1:
        raise ConfigError(
            f"keys: {job.name}'s scope has {width} columns ({', '.join(job.scope)}): give each"
            " key as JSON with --json, e.g. '[7, \"b\"]'"
        )
    convert = _converter(_base_type(conn, job.target, job.scope[0]))
    keys = []
    for text in texts:
        try:
            keys.append(convert(text))
        except ValueError:
            raise ConfigError(
                f"keys: {text!r} is not a value of {job.target}.{job.scope[0]}"
            ) from None
    return keys


def _json_key(job: QueueJob, text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"keys: expected JSON (--json), got {text!r}: {exc}") from None
    if isinstance(value, dict):
        missing = [c for c in job.scope if c not in value]
        extra = sorted(set(value) - set(job.scope))
        if missing or extra:
            raise ConfigError(f"keys: {job.name}'s scope is ({', '.join(job.scope)}), got {text!r}")
        value = [value[c] for c in job.scope]
    key_json(value, len(job.scope))  # checked here, to name the key
    return tuple(value) if isinstance(value, list) else value


def _base_type(conn: Connection, table: str, column: str) -> str:
    row = execute(
        conn,
        "select coalesce(nullif(t.typbasetype, 0), t.oid)::regtype::text"
        " from pg_attribute a join pg_type t on t.oid = a.atttypid"
        " where a.attrelid = to_regclass(%s) and a.attname = %s and not a.attisdropped",
        (table, column),
    ).fetchone()
    return str(row[0]) if row else "text"


def _converter(type_name: str) -> Any:
    if type_name in ("smallint", "integer", "bigint"):
        return int
    if type_name in ("real", "double precision"):
        return float
    if type_name == "boolean":
        return _boolean
    return str


def _boolean(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "t", "yes", "on", "1"):
        return True
    if lowered in ("false", "f", "no", "off", "0"):
        return False
    raise ValueError(text)


@dataclass(frozen=True, slots=True)
class Enqueued:
    added: int
    revived: int
    pending: int  #: already in the queue, live: left as they were


def enqueue_keys(
    engine: Engine, store: Store, job: QueueJob, texts: Sequence[str], *, as_json: bool
) -> Enqueued:
    """``pgjobs enqueue``: the keys into the job's queue, in one transaction."""
    with _transaction(engine, store) as conn:
        keys = parse_keys(conn, job, texts, as_json=as_json)
        stored = sorted({key_json(k, len(job.scope)) for k in keys})
        dead = execute(
            conn,
            sql.SQL(
                "select count(*) from {} where job = %s and key = any(%s::jsonb[])"
                " and dead_at is not null"
            ).format(store.table("queue")),
            (job.name, stored),
        ).fetchone()[0]  # type: ignore[index]
        changed = enqueue(conn, job, keys, schema=store.schema)
    return Enqueued(added=changed - dead, revived=dead, pending=len(stored) - changed)


@dataclass(frozen=True, slots=True)
class Revived:
    revived: int
    #: of the keys given, those that were not dead (pending, or not queued)
    not_dead: int
    #: items that waited for their retry, due now (``retrying``)
    retried: int = 0


def revive(
    engine: Engine,
    store: Store,
    job: QueueJob,
    texts: Sequence[str] | None,
    *,
    as_json: bool = False,
    retrying: bool = False,
) -> Revived:
    """``pgjobs revive``: the job's dead items (those of ``texts``, else all)
    due again now, with their attempts reset; the job's schedulers are woken.
    ``retrying``: the items waiting for their retry after a failure too, due
    now with their attempts kept (``revive --retrying``)."""
    with _transaction(engine, store) as conn:
        only, params = sql.SQL(""), [job.name]
        stored: list[str] = []
        if texts:
            keys = parse_keys(conn, job, texts, as_json=as_json)
            stored = sorted({key_json(k, len(job.scope)) for k in keys})
            only = sql.SQL(" and key = any(%s::jsonb[])")
            params.append(stored)  # type: ignore[arg-type]
        count = execute(
            conn,
            sql.SQL(
                "update {} set attempts = 0, dead_at = null, last_error = null,"
                " not_before = now(), enqueued_at = now(), seq = {}()"
                " where job = %s and dead_at is not null{}"
            ).format(store.table("queue"), store.table("queue_seq"), only),
            params,
        ).rowcount
        retried = 0
        if retrying:
            retried = execute(
                conn,
                sql.SQL(
                    "update {} set not_before = now() where job = %s and dead_at is null"
                    " and attempts > 0 and not_before > now(){}"
                ).format(store.table("queue"), only),
                params,
            ).rowcount
        if count or retried:
            execute(conn, "select pg_notify(%s, '')", (channel(store.schema, job.name),))
    return Revived(
        revived=count,
        not_dead=len(stored) - count - retried if texts else 0,
        retried=retried,
    )


class Operator:
    """The operator's commands on the jobs of a config and its plugins
    (what ``pgjobs pause|resume|enqueue|revive`` print), with the config's
    ``call_timeout`` on each round trip and its ``auto_migrate``."""

    def __init__(self, config: Config, registry: Registry, url: str | None) -> None:
        self.registry = registry
        self.store = Store(config.schema, auto_migrate=config.auto_migrate)
        self.url = url
        self.call_timeout = config.call_timeout.total_seconds()

    def _engine(self) -> contextlib.AbstractContextManager[Engine]:
        return engine_for(self.url, call_timeout=self.call_timeout)

    def pause(self, name: str, *, reason: str | None) -> str:
        job = self.registry.get(name)
        with self._engine() as engine:
            found, new = pause(engine, self.store, job, reason=reason)
        why = f" ({found.reason})" if found.reason else ""
        if new:
            return f"pgjobs: paused {name}{why}; every scheduler skips it from its next tick"
        return f"pgjobs: {name} was paused already, since {found.since:%Y-%m-%d %H:%M:%S %Z}{why}"

    def resume(self, name: str) -> str:
        job = self.registry.get(name)
        with self._engine() as engine:
            ended = resume(engine, self.store, job)
        if ended is None:
            return f"pgjobs: {name} was not paused"
        return f"pgjobs: resumed {name} (paused since {ended.since:%Y-%m-%d %H:%M:%S %Z})"

    def enqueue(self, name: str, keys: Sequence[str], *, as_json: bool) -> str:
        job = queue_job(self.registry.get(name))
        with self._engine() as engine:
            done = enqueue_keys(engine, self.store, job, keys, as_json=as_json)
        return (
            f"pgjobs: {name}: {done.added + done.revived} item(s) enqueued ({done.added} added,"
            f" {done.revived} revived); {done.pending} pending already"
        )

    def revive(
        self, name: str, keys: Sequence[str], *, as_json: bool, retrying: bool = False
    ) -> str:
        job = queue_job(self.registry.get(name))
        with self._engine() as engine:
            done = revive(
                engine, self.store, job, list(keys) or None, as_json=as_json, retrying=retrying
            )
        line = f"pgjobs: {name}: revived {done.revived} dead item(s)"
        if retrying:
            line += f", {done.retried} waiting for their retry (due now)"
        if done.not_dead:
            waiting = "dead nor waiting for a retry" if retrying else "dead"
            line += (
                f"; {done.not_dead} of the keys given were not {waiting} (pending or not queued)"
            )
        return line


__all__ = [
    "Enqueued",
    "Operator",
    "Pause",
    "Revived",
    "check_line",
    "enqueue_keys",
    "last_check_of",
    "parse_keys",
    "pause",
    "paused_line",
    "paused_of",
    "queue_job",
    "resume",
    "revive",
    "schedulers_table",
]
