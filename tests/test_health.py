"""Failures an operator and a health check can read (issue 37): ``pgjobs
once`` exits 1 when items failed and says how many; ``pgjobs status`` shows
a queue's failing and dead items apart; ``pgjobs status --health`` fails on
dead items past ``--max-dead`` and passes without; ``pgjobs revive
--retrying`` runs an item waiting in its item backoff now."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import create_engine, text

import pgjobs
from pgjobs.cli import cli

SCHEMA = """
create table item (id int primary key);
create table item_src (item_id int not null references item, k int not null, v int not null,
                       primary key (item_id, k));
create table item_key (item_id int not null references item, k int not null, v int not null,
                       primary key (item_id, k));
insert into item select generate_series(1, 3);
insert into item_src select i, k, i * 10 + k from generate_series(1, 3) i, generate_series(1, 2) k;
"""

# item 3 divides by zero: it fails, its neighbours commit
CONFIG = """
[jobs.keys]
kind = "queue"
target = "item_key"
scope = ["item_id"]
sql = "select item_id, k, v / (case when item_id = 3 then 0 else 1 end) as v from item_src where item_id = any(:keys)"
every = "1h"
max_attempts = 2
item_backoff = "1h"
"""


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def cfg(tmp_path: Path, env_db: str) -> str:
    engine = create_engine(env_db)
    with engine.begin() as conn:
        conn.exec_driver_sql(SCHEMA)
    pgjobs.install(engine)
    with engine.begin() as conn:
        pgjobs.enqueue(conn, "keys", [1, 2, 3])
    engine.dispose()
    path = tmp_path / "pgjobs.toml"
    path.write_text(textwrap.dedent(CONFIG))
    return str(path)


def attempts(url: str) -> list[tuple[str, int, bool]]:
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                text("select key::text, attempts, dead_at is not null from pgjobs.queue")
            )
            return [tuple(r) for r in rows]  # type: ignore[misc]
    finally:
        engine.dispose()


def test_once_exits_1_on_failed_items_status_shows_them_and_health_fails_on_dead_ones(
    cfg: str, env_db: str
) -> None:
    # the healthy start: nothing failing, nothing dead
    assert invoke("status", "--health", "-c", cfg).exit_code == 0

    first = invoke("once", "keys", "-c", cfg, "--no-check")
    assert first.exit_code == 1, first.output
    assert "items 2 (1 failed)" in first.stdout
    assert "keys: 1 item(s) failed" in first.stderr
    assert attempts(env_db) == [("[3]", 1, False)]

    status = invoke("status", "-c", cfg)
    assert status.exit_code == 0  # the job is not failing: one item is
    assert "1 (1 failing)" in status.stdout
    health = invoke("status", "--health", "-c", cfg)
    assert (health.exit_code, health.stdout.strip()) == (0, "pgjobs: healthy")

    # in its item backoff (1 h): a forced once finds nothing due...
    assert "idle" in invoke("once", "keys", "-c", cfg, "--no-check").stdout
    # ...revive --retrying makes it due now, attempts kept
    revived = invoke("revive", "keys", "--retrying", "-c", cfg)
    assert revived.exit_code == 0
    assert "1 waiting for their retry (due now)" in revived.stdout
    assert attempts(env_db) == [("[3]", 1, False)]
    assert invoke("once", "keys", "-c", cfg, "--no-check").exit_code == 1
    assert attempts(env_db) == [("[3]", 2, True)]  # max_attempts 2: parked

    status = invoke("status", "-c", cfg)
    assert "0 (1 dead)" in status.stdout  # depth counts live items
    assert "keys: 1 dead item(s)" in status.stdout
    health = invoke("status", "--health", "-c", cfg)
    assert health.exit_code == 1
    assert health.stdout.strip() == "pgjobs: unhealthy: keys: 1 dead item(s), more than 0"
    assert invoke("status", "--health", "--max-dead", "1", "-c", cfg).exit_code == 0
