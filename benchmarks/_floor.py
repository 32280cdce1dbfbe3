"""The floor a queue worker is measured against: a plain psycopg worker as a
user of a generic queue writes it, on the same items and derived rows as
``queue_bench.py``'s job.

LISTEN on a channel; per item one transaction: take the entry off a queue
table, delete the item's derived rows, insert them again, log. No
pipelining, no batching, no diff: every statement its own round trip.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import psycopg

SCHEMA = """
create table floor_queue (key int primary key, enqueued_at timestamptz not null default now());
create table floor_derived (
    parent_id int not null references parent (id) on delete cascade,
    bucket int not null,
    total bigint not null,
    n int not null,
    primary key (parent_id, bucket)
);
create table floor_log (id bigserial primary key, parent_id int not null, rows int not null,
                        at timestamptz not null default now());
"""

CHANNEL = "floor_queue"

_TAKE = (
    "delete from floor_queue where key = (select key from floor_queue order by key"
    " limit 1 for update skip locked) returning key"
)
_DELETE = "delete from floor_derived where parent_id = %s"
_INSERT = (
    "insert into floor_derived (parent_id, bucket, total, n)"
    " select s.parent_id, s.val %% 5, sum(s.val) * p.factor, count(*)::int"
    " from source s join parent p on p.id = s.parent_id where s.parent_id = %s"
    " group by s.parent_id, s.val %% 5, p.factor"
)
_LOG = "insert into floor_log (parent_id, rows) values (%s, %s)"


def install(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as pg:
        pg.execute(SCHEMA)


def enqueue(pg: psycopg.Connection, key: int) -> None:
    """In the caller's transaction: the entry and the notification."""
    pg.execute("insert into floor_queue (key) values (%s) on conflict do nothing", (key,))
    pg.execute(f"notify {CHANNEL}")


class FloorWorker:
    """The worker, in a thread of its own; ``processed(key)`` is called for
    each item inside its transaction, just before its commit (where
    pgjobs' ``after`` runs)."""

    def __init__(self, dsn: str, processed: Callable[[int], None]) -> None:
        self.dsn = dsn
        self.processed = processed
        self.stop = threading.Event()
        self.listening = threading.Event()
        self.thread = threading.Thread(target=self._run, name="floor-worker", daemon=True)

    def __enter__(self) -> FloorWorker:
        self.thread.start()
        assert self.listening.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)

    def _run(self) -> None:
        with (
            psycopg.connect(self.dsn, autocommit=True) as listen,
            psycopg.connect(self.dsn) as pg,
        ):
            listen.execute(f"listen {CHANNEL}")
            self.listening.set()
            while not self.stop.is_set():
                self._drain(pg)
                # wake on a notification, or look again after 1 s
                for _ in listen.notifies(timeout=1.0, stop_after=1):
                    pass

    def _drain(self, pg: psycopg.Connection) -> None:
        while True:
            with pg.transaction():
                row = pg.execute(_TAKE).fetchone()
                if row is None:
                    return
                key = row[0]
                pg.execute(_DELETE, (key,))
                rows = pg.execute(_INSERT, (key,)).rowcount
                pg.execute(_LOG, (key, rows))
                self.processed(key)


def now() -> float:
    return time.perf_counter()
