"""Property test of the diff writer on real PostgreSQL (hypothesis).

Random target contents, random new rows, random parent deletions (committed
by another connection either while the recompute computes, or after the
difference is taken and before the writer locks anything), plain or chunked
writes. Expected: the target equals the new rows minus those of dead
parents, and the stats count exactly what a model of the writer predicts.

One database serves every example (tables reset in between), so the test
stays within seconds.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Json

import pgjobs
import pgjobs.diff.plan

PARENTS = range(1, 7)
TAGS = range(1, 4)

SCHEMA = """
create table parent (id int primary key);
create table tag (id int primary key);
create table derived (
    id int primary key,
    parent_id int not null references parent on delete cascade,
    tag_id int references tag on delete set null,
    v int,
    doc json
);
"""

Row = tuple[int, int | None, int | None, str | None]  # parent, tag, v, doc as json text

rows_st = st.dictionaries(
    keys=st.integers(0, 15),
    values=st.tuples(
        st.sampled_from(list(PARENTS)),
        st.none() | st.sampled_from(list(TAGS)),
        st.none() | st.integers(0, 2),
        st.none() | st.builds(lambda a: {"a": a}, st.integers(0, 1)),
    ),
    max_size=12,
)


def as_row(value: tuple[Any, ...]) -> Row:
    parent, tag, v, doc = value
    return (parent, tag, v, None if doc is None else json.dumps(doc))


def model(
    old: dict[int, Row],
    new: dict[int, Row],
    dead_parents: set[int],
    dead_tags: set[int],
    timing: str,
) -> tuple[dict[int, Row], pgjobs.DiffStats]:
    """What the writer must leave and count. The user's deletes cascade
    (parent) or set NULL (tag); the difference is taken after them
    (``timing == "compute"``) or before them (``"lock"``)."""

    def alive(row: Row) -> bool:
        return row[0] not in dead_parents and (row[1] is None or row[1] not in dead_tags)

    current = {
        k: (p, None if t in dead_tags else t, v, d)
        for k, (p, t, v, d) in old.items()
        if p not in dead_parents
    }
    base = current if timing == "compute" else old
    state = dict(current)
    counts = dict(inserted=0, updated=0, deleted=0, skipped_missing_parent=0, unchanged=0)
    for k, row in new.items():
        if k in base and base[k] == row:
            counts["unchanged"] += 1  # not in the difference: left as it is
        elif not alive(row):
            counts["skipped_missing_parent"] += 1
            if k in state:
                del state[k]
                counts["deleted"] += 1
        elif k not in base or k not in state:
            # new, or planned as an update and cascaded away meanwhile
            state[k] = row
            counts["inserted"] += 1
        elif state[k] != row:
            state[k] = row
            counts["updated"] += 1
        else:
            counts["unchanged"] += 1  # already equal at write time
    for k in base:
        if k not in new and k in state:
            del state[k]
            counts["deleted"] += 1
    return state, pgjobs.DiffStats(**counts)


@settings(
    max_examples=45,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    old=rows_st,
    new=rows_st,
    dead_parents=st.sets(st.sampled_from(list(PARENTS)), max_size=3),
    dead_tags=st.sets(st.sampled_from(list(TAGS)), max_size=2),
    timing=st.sampled_from(["compute", "lock"]),
    chunk_parents=st.sampled_from([None, 2]),
    keyed=st.booleans(),
)
def test_target_equals_new_rows_minus_dead_parents(
    engine, db_url, old, new, dead_parents, dead_tags, timing, chunk_parents, keyed
):
    dsn = db_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as pg:
        if not pg.execute("select to_regclass('derived')").fetchone()[0]:
            pg.execute(SCHEMA)
        pg.execute("truncate derived, parent, tag")
        pg.execute("insert into parent select generate_series(1, 6)")
        pg.execute("insert into tag select generate_series(1, 3)")
        with pg.cursor() as cur:
            cur.executemany(
                "insert into derived values (%s, %s, %s, %s, %s)",
                [(k, p, t, v, None if d is None else Json(d)) for k, (p, t, v, d) in old.items()],
            )

    def delete_parents() -> None:
        with psycopg.connect(dsn, autocommit=True) as user:
            if dead_parents:
                user.execute("delete from parent where id = any(%s)", (sorted(dead_parents),))
            if dead_tags:
                user.execute("delete from tag where id = any(%s)", (sorted(dead_tags),))

    new_rows = [(k, *value) for k, value in new.items()]

    def compute(conn):
        if timing == "compute":
            delete_parents()  # computed already; the user deletes before the diff
        return new_rows

    fired = []

    def progress(phase, done, total):
        if timing == "lock" and phase == "lock" and not fired:
            fired.append(True)
            delete_parents()  # the difference is taken; no row is locked yet

    job = pgjobs.RecomputeJob(
        name="prop", target="derived", compute=compute, chunk_parents=chunk_parents
    )
    # keyed: plan every pass as nested loops over the key index, as the writer
    # does for passes touching few of a large target's rows
    saved = pgjobs.diff.plan.keyed_pass
    decisions: list[bool] = []

    def keyed_pass(rows: int, target_rows: float) -> bool:
        decisions.append(keyed)
        return keyed

    pgjobs.diff.plan.keyed_pass = keyed_pass
    try:
        with pgjobs.Runner(engine) as runner:
            result = runner.tick(job, force=True, progress=progress)
    finally:
        pgjobs.diff.plan.keyed_pass = saved
    assert result.outcome == "ran", result.error
    assert set(decisions) <= {keyed}
    assert decisions or not any(result.detail["planned"].values())  # no pass: nothing to write

    if timing == "lock" and not fired:
        delete_parents()  # an empty difference: nothing was locked, nothing written
    with psycopg.connect(dsn, autocommit=True) as pg:
        actual = {
            r[0]: tuple(r[1:])
            for r in pg.execute("select id, parent_id, tag_id, v, doc::text from derived")
        }

    old_rows = {k: as_row(v) for k, v in old.items()}
    new_model = {k: as_row(v) for k, v in new.items()}
    expected, stats = model(old_rows, new_model, dead_parents, dead_tags, timing)
    assert actual == expected
    assert result.stats == stats
    assert result.detail["deferred"] == 0
    if timing == "compute":
        # the headline property, stated directly
        assert actual == {
            k: row
            for k, row in new_model.items()
            if row[0] not in dead_parents and (row[1] is None or row[1] not in dead_tags)
        }
