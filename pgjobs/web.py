"""The status page: jobs, queues, dead items and the recent runs with their
phases, server-rendered from pgjobs' tables (no JavaScript, no build step;
it refreshes itself).

* at the top, a warning while a snapshot or transaction holds the
  database's xmin horizon back past ``horizon_warning``, naming its holder;
* ``/``: every job (kind, group, schedule, last outcome and when, next
  attempt, failing since and the error, rows changed), the queues (depth,
  due, oldest due, dead items with their last error), a timeline of the
  recent runs by job, and the runs with their phases (compute, write, row
  locks) as bars.
* ``/job/NAME``: one job, its queue and its runs; each job's row links there.

Read-only (GET and HEAD only; one read-only transaction a page, with a
statement timeout). The database is shown without its password; every
value that comes from the database or a job's definition is escaped.

What it shows is read by :mod:`pgjobs.snapshot`; this module renders it.
Served by ``pgjobs run --http 127.0.0.1:8080``; in a FastAPI application::

    app = FastAPI(lifespan=pgjobs.lifespan("pgjobs.toml"))
    app.mount("/pgjobs", pgjobs.web.asgi_app())   # finds the lifespan's scheduler
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

from .durations import format_duration
from .horizon import horizon_line
from .markup import CSS, Markup, el, esc
from .serve import ASGIApp, Request, Response, Source, WSGIApp, asgi, wsgi
from .snapshot import JOB_RUNS, RUNS, JobView, Snapshot, read
from .store import QUIET_OUTCOMES

if TYPE_CHECKING:
    from .scheduler import Scheduler


def _when(value: datetime | None, now: datetime) -> Markup:
    """``12s ago`` / ``in 14m`` with the UTC time in a tooltip."""
    if value is None:
        return esc("-")
    delta = now - value
    text = (
        f"{format_duration(timedelta(seconds=int(delta.total_seconds())))} ago"
        if delta >= timedelta(0)
        else f"in {format_duration(timedelta(seconds=int(-delta.total_seconds()) or 1))}"
    )
    stamp = value.astimezone(UTC)
    return el("time", text, datetime=stamp.isoformat(), title=f"{stamp:%Y-%m-%d %H:%M:%S} UTC")


def _next(view: JobView, now: datetime) -> Markup:
    at = view.state.get("next_attempt_at")
    if at is None:
        return esc("-")
    if at <= now:
        return esc("due")
    return _when(at, now)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1:
        return f"{value * 1000:.0f} ms" if value >= 0.01 else f"{value * 1000:.1f} ms"
    if value < 100:
        return f"{value:.2f} s"
    return format_duration(timedelta(seconds=round(value)))


def _outcome(outcome: str | None) -> Markup:
    if not outcome:
        return el("span", "never ran", class_="muted")
    return el("span", outcome, class_=f"outcome {outcome}")


def _changed(run: Mapping[str, Any]) -> str:
    if not run:
        return "-"
    text = f"+{run['inserted']:,} ~{run['updated']:,} -{run['deleted']:,}"
    if run.get("skipped_missing_parent"):
        text += f", {run['skipped_missing_parent']:,} skipped"
    return text


def _drift(check: Mapping[str, Any]) -> str:
    """The last check's figures: what a recompute would write then."""
    if not check:
        return "-"
    if check.get("error"):
        return "check failed"
    if not (check["inserted"] or check["updated"] or check["deleted"]):
        return "none"
    return _changed(check)


def _samples(title: str, run: Mapping[str, Any], samples: Mapping[str, Any], now: Any) -> Markup:
    """A check's or a repair's figures and its sampled keys, by kind of change."""
    if not run:
        return el("p", el("strong", title), ": ", el("span", "none yet", class_="muted"))
    head = el(
        "p",
        el("strong", title),
        " ",
        _when(run.get("finished_at"), now),
        ": ",
        run.get("error") or _changed(run),
    )
    rows = []
    order = ("inserted", "updated", "deleted", "skipped_missing_parent", "on_the_way")
    for kind in sorted(samples, key=lambda k: (order.index(k) if k in order else 9, k)):
        items = samples[kind]
        if not isinstance(items, list) or not items:
            continue
        keys = [item.get("key", item) if isinstance(item, Mapping) else item for item in items]
        rows.append(
            el(
                "tr",
                el("td", kind),
                el("td", el("code", "; ".join(json.dumps(k, default=str) for k in keys))),
            )
        )
    if not rows:
        return head
    return el("div", head, el("table", el("tbody", rows), class_="samples"))


def _drift_section(view: JobView, now: Any) -> list[Markup]:
    """The last check and the last repair (on a target that workers
    maintain, what the queue path missed), with their samples."""
    check = view.last_checked
    detail = (check.get("detail") or {}).get("check", {}) if check else {}
    repaired = (view.last_ran.get("detail") or {}).get("repaired", {}) if view.last_ran else {}
    return [
        el("h2", "Drift"),
        _samples("Last check", check, detail.get("samples", {}), now),
        _samples("Last repair", view.last_ran, repaired, now),
    ]


def _slicing(view: JobView) -> Markup | None:
    """A sliced run in progress: its pieces done of how many."""
    run = view.sliced
    if not run:
        return None
    return el(
        "span",
        f" slicing {run['done']:,}/{run['pieces']:,}",
        class_="outcome running",
        title=f"{run['written']:,} rows written in {run['slices']:,} slices"
        f" by {len(run.get('processes') or [])} process(es)",
    )


def _job_href(base: str, name: str) -> str:
    return f"{base}/job/{quote(name, safe='')}"


def _anchor(name: str) -> str:
    return "job-" + quote(name, safe="")


#: the jobs table's header cells; a row under a job (paused, failing) spans them all
_JOB_COLUMNS = (
    "Job",
    "Kind",
    "Group",
    "Schedule",
    "Last outcome",
    "When",
    "Next attempt",
    "Failing since",
    "Rows changed (last run)",
    "Drift (last check)",
    "Queue",
)
_JOB_SPAN = str(len(_JOB_COLUMNS))


def _jobs_table(snap: Snapshot, base: str) -> Markup:
    rows = []
    for v in snap.jobs:
        failing = v.failures > 0
        rows.append(
            el(
                "tr",
                el(
                    "td",
                    el("a", v.name, href=_job_href(base, v.name)),
                    None if v.registered else el("span", " (not registered)", class_="muted"),
                    el("span", " paused", class_="outcome paused") if _paused(v) else None,
                ),
                el("td", v.kind),
                el("td", v.group),
                el("td", v.schedule),
                el(
                    "td",
                    _outcome(v.last.get("outcome")),
                    # retried within seconds, not failures (docs/failover.md)
                    el("span", f" ({v.transient:,} transient)", class_="muted")
                    if v.transient
                    else None,
                    _slicing(v),
                ),
                el("td", _when(v.last.get("finished_at"), snap.now)),
                el("td", _next(v, snap.now)),
                el(
                    "td",
                    _when(v.failing_since or v.state.get("last_failure_at"), snap.now)
                    if failing
                    else "-",
                    f" ({v.failures}\u00d7)" if failing else None,
                ),
                el("td", _changed(v.last_ran), class_="num"),
                el("td", _drift(v.last_checked), class_="num"),
                el(
                    "td",
                    "-" if v.queue is None else f"{v.queue.depth:,}",
                    class_="num",
                ),
                id=_anchor(v.name),
                class_="job failing" if failing else "job",
                data_job=v.name,
            )
        )
        if _paused(v):
            rows.append(_paused_row(v, snap.now))
        if failing:
            sqlstate = v.state.get("last_sqlstate")
            rows.append(
                el(
                    "tr",
                    el(
                        "td",
                        el("pre", v.state.get("last_error") or "", class_="error-text"),
                        el("span", f"SQLSTATE {sqlstate}", class_="muted") if sqlstate else None,
                        colspan=_JOB_SPAN,
                        class_="wrap",
                    ),
                    class_="error",
                    data_job=v.name,
                )
            )
    head = el("tr", [el("th", h) for h in _JOB_COLUMNS])
    if not rows:
        rows = [el("tr", el("td", "no jobs", colspan=_JOB_SPAN, class_="muted"))]
    return el("table", el("thead", head), el("tbody", rows), id="jobs")


def _paused(view: JobView) -> bool:
    return view.state.get("paused_at") is not None


def _paused_row(view: JobView, now: datetime) -> Markup:
    """``paused 5m ago by ops@host: reason`` under a paused job (pgjobs pause)."""
    state = view.state
    reason = state.get("paused_reason")
    return el(
        "tr",
        el(
            "td",
            "paused ",
            _when(state.get("paused_at"), now),
            f" by {state.get('paused_by') or '?'}",
            f": {reason}" if reason else "",
            f"; pgjobs resume {view.name} resumes it",
            colspan=_JOB_SPAN,
            class_="wrap",
        ),
        class_="paused",
        data_job=view.name,
    )


def _schedulers_table(snap: Snapshot) -> Markup:
    """The schedulers by their heartbeats: live, or gone quiet (docs/operate.md)."""
    rows = [
        el(
            "tr",
            el("td", f"{s['host']}:{s['pid']}"),
            el("td", s["version"]),
            el("td", _when(s["started_at"], snap.now)),
            el("td", _when(s["last_seen"], snap.now)),
            el(
                "td",
                el("span", "live", class_="outcome ran")
                if s["live"]
                else el("span", "gone quiet", class_="outcome failed"),
            ),
            el("td", ", ".join(s["jobs"]), class_="wrap"),
            class_="scheduler",
        )
        for s in snap.schedulers
    ]
    if not rows:
        rows = [el("tr", el("td", "none has recorded a heartbeat", colspan="6", class_="muted"))]
    head = el(
        "tr",
        [el("th", h) for h in ("Scheduler", "Version", "Started", "Last seen", "State", "Jobs")],
    )
    return el("table", el("thead", head), el("tbody", rows), id="schedulers")


def _queues_table(snap: Snapshot, base: str) -> Markup:
    queues = [v.queue for v in snap.jobs if v.queue is not None]
    known = {q.job for q in queues}
    queues += [q for q in snap.queues if q.job not in known]
    if not queues:
        return el("p", "no queue jobs", class_="muted")
    head = el(
        "tr",
        [el("th", h) for h in ("Queue job", "Depth", "Due", "Retrying", "Dead", "Oldest due")],
    )
    rows = [
        el(
            "tr",
            el("td", el("a", q.job, href=_job_href(base, q.job))),
            el("td", f"{q.depth:,}", class_="num"),
            el("td", f"{q.due:,}", class_="num"),
            el("td", f"{q.retrying:,}", class_="num"),
            el("td", f"{q.dead:,}", class_="num"),
            el(
                "td",
                "-" if q.oldest_due_seconds is None else _seconds(q.oldest_due_seconds),
                class_="num",
            ),
            class_="queue",
            data_job=q.job,
        )
        for q in queues
    ]
    return el("table", el("thead", head), el("tbody", rows), id="queues")


def _dead_table(snap: Snapshot) -> Markup:
    if not snap.dead:
        return el("p", "no dead items", class_="muted")
    head = el("tr", [el("th", h) for h in ("Job", "Key", "Attempts", "Parked", "Last error")])
    rows = [
        el(
            "tr",
            el("td", d["job"]),
            el("td", el("code", d["key"])),
            el("td", str(d["attempts"]), class_="num"),
            el("td", _when(d["dead_at"], snap.now)),
            el("td", el("pre", d["last_error"] or "", class_="error"), class_="wrap"),
            class_="dead",
        )
        for d in snap.dead
    ]
    return el("table", el("thead", head), el("tbody", rows), id="dead")


def _ms(run: Mapping[str, Any], key: str) -> float:
    value = run.get(key)
    return 0.0 if value is None else max(float(value), 0.0) / 1000


def _phase_bar(run: Mapping[str, Any]) -> Markup:
    """The run's wall time as a bar: compute, write, the row-lock window
    (the end of the writes), and the rest (lock, claim, commit, records)."""
    total = max((run["finished_at"] - run["started_at"]).total_seconds(), 0.0)
    compute, write, locks = _ms(run, "compute_ms"), _ms(run, "write_ms"), _ms(run, "lock_ms")
    locks = min(locks, write) if write else locks
    if total <= 0 or run["outcome"] != "ran":
        return el("div", class_="bar", title=f"{_seconds(total)}")

    def pct(x: float) -> str:
        return f"width:{min(100.0, 100 * x / total):.2f}%"

    title = (
        f"compute {_seconds(compute)}, write {_seconds(write)}, row locks {_seconds(locks)},"
        f" of {_seconds(total)}"
    )
    return el(
        "div",
        el("span", class_="compute", style=pct(compute)),
        el("span", class_="write", style=pct(max(write - locks, 0.0))),
        el("span", class_="locks", style=pct(locks)) if locks > 0 else None,
        class_="bar",
        title=title,
    )


def _runs_table(snap: Snapshot, base: str) -> Markup:
    if not snap.runs:
        return el("p", "no runs recorded yet", class_="muted")
    head = el(
        "tr",
        [
            el("th", h)
            for h in (
                "Started",
                "Job",
                "Outcome",
                "Took",
                "Phases",
                "Compute",
                "Write",
                "Row locks",
                "Rows",
                "Items",
                "Error",
            )
        ],
    )
    rows = []
    for run in snap.runs:
        total = (run["finished_at"] - run["started_at"]).total_seconds()
        ran = run["outcome"] == "ran"
        error = run.get("error")
        rows.append(
            el(
                "tr",
                el("td", _when(run["started_at"], snap.now)),
                el("td", el("a", run["job"], href=_job_href(base, run["job"]))),
                el("td", _outcome(run["outcome"])),
                el("td", _seconds(total), class_="num"),
                el("td", _phase_bar(run)),
                el("td", _seconds(_ms(run, "compute_ms")) if ran else "-", class_="num"),
                el("td", _seconds(_ms(run, "write_ms")) if ran else "-", class_="num"),
                el("td", _seconds(_ms(run, "lock_ms")) if ran else "-", class_="num"),
                el("td", _changed(run) if ran else "-", class_="num"),
                el("td", f"{run['items']:,}" if run.get("items") else "-", class_="num"),
                el(
                    "td",
                    el("pre", error, class_="error") if error else "",
                    class_="wrap",
                ),
                class_=f"run {run['outcome']}",
                data_job=run["job"],
            )
        )
    legend = el(
        "p",
        "Phases of each run's wall time:",
        Markup('<span style="background:var(--compute)"></span>'),
        "compute (no row locks)",
        Markup('<span style="background:var(--write)"></span>'),
        "write",
        Markup('<span style="background:var(--locks)"></span>'),
        "row locks held",
        Markup('<span style="background:var(--other)"></span>'),
        "the rest (lock, claim, commit)",
        class_="legend muted",
    )
    return Markup(legend + el("table", el("thead", head), el("tbody", rows), id="runs"))


_STEPS = (60, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


def _timeline(snap: Snapshot) -> Markup:
    """The runs shown, by job, on one time axis ending now."""
    runs = [r for r in snap.runs if r["outcome"] in ("ran", "failed")]
    if not runs:
        return Markup("")
    now = snap.now
    oldest = min(r["started_at"] for r in runs)
    span = (now - oldest).total_seconds()
    window = next((s for s in _STEPS if s >= span * 1.05), _STEPS[-1])
    start = now - timedelta(seconds=window)
    lanes = list(dict.fromkeys(r["job"] for r in sorted(runs, key=lambda r: r["job"])))
    left, width, lane_h = 170, 1000, 20
    height = 24 + lane_h * len(lanes)
    parts: list[Markup] = []
    tick = window / 6
    for i in range(7):
        x = left + (width - left - 10) * i / 6
        at = start + timedelta(seconds=tick * i)
        parts.append(el("line", x1=f"{x:.1f}", x2=f"{x:.1f}", y1="0", y2=str(height - 16)))
        label = "now" if i == 6 else f"-{format_duration(now - at)}"
        parts.append(el("text", label, x=f"{x:.1f}", y=str(height - 4), text_anchor="middle"))
    for n, lane in enumerate(lanes):
        y = 4 + n * lane_h
        parts.append(el("text", lane[:28], x="4", y=str(y + 13)))
        for r in runs:
            if r["job"] != lane or r["finished_at"] < start:
                continue
            x0 = (
                left
                + (width - left - 10) * max((r["started_at"] - start).total_seconds(), 0) / window
            )
            x1 = left + (width - left - 10) * (r["finished_at"] - start).total_seconds() / window
            took = (r["finished_at"] - r["started_at"]).total_seconds()
            stamp = r["started_at"].astimezone(UTC)
            parts.append(
                el(
                    "rect",
                    el("title", f"{lane} {r['outcome']} at {stamp:%H:%M:%S} UTC, {_seconds(took)}"),
                    x=f"{x0:.1f}",
                    y=str(y + 2),
                    width=f"{max(x1 - x0, 2.0):.1f}",
                    height=str(lane_h - 6),
                    class_=r["outcome"],
                )
            )
    return el(
        "svg",
        parts,
        class_="timeline",
        viewBox=f"0 0 {width} {height}",
        role="img",
        aria_label="recent runs by job",
    )


def _page(title: str, base: str, snap: Snapshot, body: Sequence[Markup], refresh: int) -> bytes:
    stamp = snap.now.astimezone(UTC)
    doc = el(
        "html",
        el(
            "head",
            el("meta", charset="utf-8"),
            el("meta", name="viewport", content="width=device-width, initial-scale=1"),
            el("meta", http_equiv="refresh", content=str(refresh)) if refresh > 0 else None,
            el("title", title),
            el("style", Markup(CSS)),
        ),
        el(
            "body",
            el(
                "header",
                el("h1", el("a", "pgjobs", href=f"{base}/")),
                el("span", title if title != "pgjobs" else None),
                el(
                    "span",
                    f"{snap.database} · {stamp:%Y-%m-%d %H:%M:%S} UTC"
                    + (f" · refreshes every {refresh}s" if refresh > 0 else ""),
                    class_="meta",
                ),
            ),
            el("main", list(body)),
        ),
        lang="en",
    )
    return ("<!doctype html>\n" + doc + "\n").encode()


class StatusPage:
    """The page's handler (:func:`asgi_app`, :func:`wsgi_app`): ``refresh``
    seconds between reloads (0: never), ``runs`` listed on the overview."""

    def __init__(self, *, refresh: int = 5, runs: int = RUNS) -> None:
        self.refresh = refresh
        self.runs = runs

    def __call__(self, source: Source, request: Request) -> Response:
        path = request.path.rstrip("/") or "/"
        if path == "/":
            return self.overview(source, request.base)
        if path.startswith("/job/"):
            return self.job(source, request.base, unquote(path[len("/job/") :]))
        return Response(404, f"not found: {request.path}\n".encode())

    def _not_installed(self, snap: Snapshot) -> Markup:
        return el(
            "p",
            "pgjobs' tables are not installed in this database yet (the scheduler's first"
            " tick installs them).",
            class_="muted",
        )

    def overview(self, source: Source, base: str) -> Response:
        snap = read(source, runs=self.runs)
        failing = sum(v.failures > 0 for v in snap.jobs)
        body = [
            *_horizon(snap),
            el("h2", f"Jobs ({len(snap.jobs)}, {failing} failing)" if failing else "Jobs"),
            _jobs_table(snap, base),
        ]
        if not snap.installed:
            body.append(self._not_installed(snap))
        else:
            body += [
                el("h2", "Queues"),
                _queues_table(snap, base),
                el("h2", "Schedulers"),
                _schedulers_table(snap),
                el("h2", "Dead items"),
                _dead_table(snap),
                el("h2", "Recent runs"),
                _timeline(snap),
                _runs_table(snap, base),
            ]
        return Response(
            200, _page("pgjobs", base, snap, body, self.refresh), "text/html; charset=utf-8"
        )

    def job(self, source: Source, base: str, name: str) -> Response:
        snap = read(source, job=name, runs=JOB_RUNS)
        view = next((v for v in snap.jobs if v.name == name), None)
        if view is None and not snap.runs:
            return Response(404, f"no job named {name!r}\n".encode())
        one = Snapshot(
            now=snap.now,
            installed=snap.installed,
            database=snap.database,
            jobs=[view] if view is not None else [],
            queues=snap.queues,
            dead=snap.dead,
            runs=snap.runs,
        )
        details: list[Markup] = []
        if view is not None:
            facts = [
                ("kind", view.kind),
                ("group", view.group),
                ("schedule", view.schedule),
                ("target", view.target),
                ("description", view.description),
                ("consecutive failures", str(view.failures)),
                ("last success", _when(view.state.get("last_success_at"), snap.now)),
                ("quiet ticks", _quiet(view.state)),
            ]
            details.append(
                el("dl", [[el("dt", k), el("dd", v)] for k, v in facts if v is not None])
            )
        body = [
            *_horizon(snap),
            el("h2", el("a", "all jobs", href=f"{base}/#{_anchor(name)}"), f" / {name}"),
            *details,
            el("h2", "State"),
            _jobs_table(one, base),
        ]
        if view is not None and view.kind == "recompute":
            body += _drift_section(view, snap.now)
        if view is None or view.queue is not None or snap.dead:
            body += [
                el("h2", "Queue"),
                _queues_table(one, base),
                el("h2", "Dead items"),
                _dead_table(one),
            ]
        body += [el("h2", "Runs"), _timeline(one), _runs_table(one, base)]
        return Response(
            200, _page(f"job {name}", base, one, body, self.refresh), "text/html; charset=utf-8"
        )


def _horizon(snap: Snapshot) -> list[Markup]:
    """The warning of a snapshot held past ``horizon_warning``, naming its holder."""
    if not snap.horizon_held or snap.horizon is None:
        return []
    return [el("p", horizon_line(snap.horizon), class_="warning", id="horizon")]


def _quiet(state: Mapping[str, Any]) -> str | None:
    """The job's counts of ticks that changed nothing, one per quiet outcome
    (``QUIET_OUTCOMES``: the ``*_ticks`` columns of ``job_state``)."""
    counts = [
        f"{state.get(f'{outcome}_ticks') or 0:,} {outcome.replace('_', ' ')}"
        for outcome in QUIET_OUTCOMES
    ]
    return ", ".join(counts) if state else None


def asgi_app(
    source: Scheduler | Source | None = None, *, refresh: int = 5, runs: int = RUNS
) -> ASGIApp:
    """The page as an ASGI app to mount (``app.mount("/pgjobs", ...)``);
    with no ``source``, it reads the scheduler of the app's :func:`pgjobs.lifespan`."""
    return asgi(StatusPage(refresh=refresh, runs=runs), source)


def wsgi_app(source: Scheduler | Source, *, refresh: int = 5, runs: int = RUNS) -> WSGIApp:
    """The page as a WSGI app (``pgjobs run --http``)."""
    return wsgi(StatusPage(refresh=refresh, runs=runs), source)


__all__ = ["StatusPage", "asgi_app", "read", "wsgi_app"]
