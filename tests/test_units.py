"""Value objects and parsers: no database needed."""

from __future__ import annotations

import math
import random
from datetime import timedelta

import pytest

import pgjobs
from pgjobs.cron import check_cron
from pgjobs.durations import (
    MAX_DURATION,
    MAX_TIMEOUT,
    format_duration,
    parse_duration,
    parse_timeout,
)


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


# -- limits --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (float("inf"), "at most 100 years"),
        (float("nan"), "expected a duration"),
        (10**30, "at most 100 years"),
        ("99999999999d", "at most 100 years"),
        ("9" * 400, "at most 100 years"),
        ("36525d1s", "at most 100 years"),
        (timedelta(days=36526), "at most 100 years"),
        (timedelta.max, "at most 100 years"),
        (-math.inf, "must not be negative"),
    ],
)
def test_parse_duration_refuses_what_no_schedule_means(bad, problem):
    with pytest.raises(pgjobs.ConfigError) as info:
        parse_duration(bad, field="jobs.x.every")
    assert str(info.value).startswith("jobs.x.every: ") and problem in str(info.value)
    assert repr(bad)[:20] in str(info.value)


def test_parse_duration_accepts_up_to_100_years():
    assert parse_duration("36525d") == MAX_DURATION == timedelta(days=36525)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (0, True),
        ("1ms", True),
        ("0.5ms", False),
        (timedelta(microseconds=999), False),
        ("24d", True),
        (timedelta(milliseconds=2**31 - 1), True),
        (timedelta(milliseconds=2**31), False),
        ("25d", False),
        ("30d", False),
    ],
)
def test_timeouts_fit_postgresqls_integer_milliseconds(value, ok):
    if ok:
        assert parse_timeout(value, field="lock_timeout") <= MAX_TIMEOUT
    else:
        with pytest.raises(pgjobs.ConfigError, match=r"^lock_timeout: must be"):
            parse_timeout(value, field="lock_timeout")


@pytest.mark.parametrize(
    ("backoff", "failures", "expected"),
    [
        (pgjobs.Backoff(initial="1s", factor=2), 2000, 86400),  # 2.0 ** 1999 overflows a float
        (pgjobs.Backoff(initial="1s", factor=2), 2**31 - 1, 86400),
        # an int factor: 2 ** (10**30) as a big integer would never finish
        (pgjobs.Backoff(initial="1s", factor=2), 10**30, 86400),
        (pgjobs.Backoff(initial="1s", factor=1e300, max="36525d"), 3, 36525 * 86400),
        (pgjobs.Backoff(initial="1s", factor=1.0000001, max="1m"), 10**12, 60),
        (pgjobs.Backoff(initial="0s", factor=3), 10**9, 0),
        (pgjobs.Backoff(initial="36525d"), 10**9, 36525 * 86400),
    ],
)
def test_backoff_delay_never_overflows(backoff, failures, expected):
    assert backoff.delay(failures) == timedelta(seconds=expected)


CRON_OK = [
    "* * * * *",
    "*/5 * * * *",
    "0 9 * * mon-fri",
    "0 0 1 jan,jul *",
    "30 2 last * *",
    "0 0 29 2 *",
    "0-30/10 1,13 1-15 */3 SUN",
    "5/15 * * * *",
]
CRON_BAD = [
    ("* * * *", "expected 5 crontab fields"),
    ("61 * * * *", "minute: '61' is outside 0-59"),
    ("0 24 * * *", "hour: '24' is outside 0-23"),
    ("0 0 0 * *", "day: '0' is outside 1-31"),
    ("0 0 * 13 *", "month: '13' is outside 1-12"),
    ("0 0 * * 7", "day_of_week: '7' is outside 0-6"),
    ("*/0 * * * *", "minute: '*/0': a step"),
    ("*/60 * * * *", "minute: '*/60': a step"),
    ("30-10 * * * *", "from high to low"),
    ("0 0 * * fri-mon", "from high to low"),
    ("0 0 * * mon-5", "day_of_week: 'mon-5'"),
    ("0 0 * jan-mar/2 *", "month: 'jan-mar/2'"),
    ("0 0 * * funday", "day_of_week: 'funday'"),
    ("0 0 last-dec * *", "day: 'last-dec'"),
    ("1,,2 * * * *", "minute: ''"),
    ("0 0 30 2 *", "never fires"),
    ("0 0 31 4,6,9,11 *", "never fires"),
]


@pytest.mark.parametrize("cron", CRON_OK)
def test_cron_expressions_the_job_accepts(cron):
    assert pgjobs.TaskJob(name="j", run=noop, every=None, cron=cron).cron == cron


@pytest.mark.parametrize(("cron", "problem"), CRON_BAD, ids=[c for c, _ in CRON_BAD])
def test_cron_expressions_the_job_refuses_naming_the_fault_and_the_value(cron, problem):
    with pytest.raises(pgjobs.ConfigError) as info:
        pgjobs.TaskJob(name="j", run=noop, every=None, cron=cron)
    message = str(info.value)
    assert message.startswith("TaskJob 'j': cron: ") and problem in message, message
    assert message.endswith(f"got {cron!r}"), message


def test_what_the_job_accepts_as_cron_apscheduler_accepts():
    # The model checks the grammar without importing APScheduler; on a
    # deterministic sample, nothing it lets through is refused by the scheduler.
    from apscheduler.triggers.cron import CronTrigger

    rng = random.Random(2)
    fields = [(0, 59, []), (0, 23, []), (1, 31, ["last"]), (1, 12, ["jan", "Jun", "dec"])]
    fields.append((0, 6, ["mon", "fri", "SUN"]))

    def item(low, high, names):
        a, b = rng.randint(low, high + 1), rng.randint(low, high + 1)
        step = rng.randint(0, high - low + 1)
        choices = ["*", f"*/{step}", f"{a}", f"{a}-{b}", f"{a}-{b}/{step}", f"{a}/{step}"]
        if names:
            choices += [rng.choice(names), f"{rng.choice(names)}-{rng.choice(names)}"]
        return rng.choice(choices)

    accepted = 0
    for _ in range(30_000):
        cron = " ".join(",".join(item(*f) for _ in range(rng.randint(1, 2))) for f in fields)
        try:
            check_cron(cron, "cron")
        except pgjobs.ConfigError:
            continue
        accepted += 1
        CronTrigger.from_crontab(cron, timezone="UTC")  # raises if the two disagree
    assert accepted > 1000  # 1,459 of 30,000 with this seed
