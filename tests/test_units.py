"""Value objects and parsers: no database needed."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

import pgjobs
from pgjobs.durations import format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("5m", 300),
        ("1h", 3600),
        ("1h30m", 5400),
        ("250ms", 0.25),
        ("2d", 172800),
        ("15", 15),
        (" 10 s ", 10),
        (42, 42),
        (1.5, 1.5),
        (timedelta(minutes=2), 120),
    ],
)
def test_parse_duration_accepts(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("bad", ["", "1x", "h", "5 minutes", "-5s", -1, True, None, [1]])
def test_parse_duration_rejects_naming_the_field(bad):
    with pytest.raises(pgjobs.ConfigError, match=r"jobs\.x\.every"):
        parse_duration(bad, field="jobs.x.every")


@pytest.mark.parametrize("seconds", [0.25, 1, 59, 61, 3600, 5400, 90061])
def test_format_duration_round_trips(seconds):
    td = timedelta(seconds=seconds)
    assert parse_duration(format_duration(td)) == td


@pytest.mark.parametrize(
    ("backoff", "failures", "expected"),
    [
        (pgjobs.Backoff(initial="1h"), 1, 3600),
        (pgjobs.Backoff(initial="1h"), 5, 3600),
        (pgjobs.Backoff(initial="30s", factor=2), 1, 30),
        (pgjobs.Backoff(initial="30s", factor=2), 3, 120),
        (pgjobs.Backoff(initial="30s", factor=2, max="1m"), 3, 60),
        (pgjobs.Backoff(initial="30s", factor=2), 20, 86400),
        (pgjobs.Backoff.coerce("10m"), 2, 600),
    ],
)
def test_backoff_delays(backoff, failures, expected):
    assert backoff.delay(failures) == timedelta(seconds=expected)


def test_backoff_jitter_stays_within_its_fraction():
    backoff = pgjobs.Backoff(initial="100s", jitter=0.2)
    rng = random.Random(7)
    delays = {backoff.delay(1, rng=rng).total_seconds() for _ in range(200)}
    assert min(delays) >= 80 and max(delays) <= 120 and len(delays) > 100


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"factor": 0.5}, "backoff.factor"),
        ({"jitter": 1.5}, "backoff.jitter"),
        ({"initial": "soon"}, "backoff.initial"),
    ],
)
def test_backoff_validation_names_the_field(kwargs, field):
    with pytest.raises(pgjobs.ConfigError, match=field):
        pgjobs.Backoff(**kwargs)


def noop(conn):
    return None


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: pgjobs.TaskJob(name="", run=noop), "name"),
        (lambda: pgjobs.TaskJob(name="bad name", run=noop), "name"),
        (lambda: pgjobs.TaskJob(name="j", run=noop, every="often"), "every"),
        (lambda: pgjobs.TaskJob(name="j", run=noop, every=0), "every"),
        (lambda: pgjobs.TaskJob(name="j", run=noop, every=None), "every or cron"),
        (lambda: pgjobs.TaskJob(name="j", run=noop, every="1m", cron="* * * * *"), "not both"),
        (lambda: pgjobs.TaskJob(name="j", run=noop, every=None, cron="daily"), "cron"),
        (lambda: pgjobs.TaskJob(name="j", run=noop, backoff="later"), "backoff"),
        (lambda: pgjobs.TaskJob(name="j", run=noop, lock_timeout="x"), "lock_timeout"),
        (lambda: pgjobs.TaskJob(name="j", run="not callable"), "run"),
        (lambda: pgjobs.RecomputeJob(name="j", compute="select 1"), "target"),
        (lambda: pgjobs.RecomputeJob(name="j", target="t", compute=""), "compute"),
        (
            lambda: pgjobs.RecomputeJob(name="j", target="t", compute="q", chunk_parents=0),
            "chunk_parents",
        ),
        (lambda: pgjobs.QueueJob(name="j", target="t", compute="q"), "scope"),
        (
            lambda: pgjobs.QueueJob(name="j", target="t", scope="a", compute="q", batch_size=0),
            "batch_size",
        ),
        (
            lambda: pgjobs.QueueJob(name="j", target="t", scope="a", compute="q", max_attempts=-1),
            "max_attempts",
        ),
    ],
)
def test_job_validation_names_the_field(factory, message):
    with pytest.raises(pgjobs.ConfigError, match=message):
        factory()


def test_jobs_normalize_and_default_their_group():
    job = pgjobs.RecomputeJob(name="scores", target="exam_score", compute="select 1", every="2m")
    assert job.group == "exam_score"
    assert job.interval == timedelta(minutes=2)
    assert job.backoff_policy == pgjobs.Backoff(initial="1h")
    assert job.schedule == "every 2m"
    worker = pgjobs.QueueJob(name="w", target="exam_score", scope="exam_id", compute="select 1")
    assert worker.scope == ("exam_id",) and worker.group == job.group
    assert pgjobs.TaskJob(name="t", run=noop).group == "t"
    changed = job.replace(every="5m")
    assert changed.interval == timedelta(minutes=5) and job.interval == timedelta(minutes=2)
    with pytest.raises(pgjobs.ConfigError, match="every"):
        job.replace(every="never")


def test_errors_default_to_their_docstring():
    assert str(pgjobs.ConfigError()) == "A job definition, option or configuration file is invalid."
    assert isinstance(pgjobs.JobError("x", sqlstate="40P01"), pgjobs.PgJobsError)
