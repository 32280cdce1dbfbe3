"""The status page: opened in a real headless Chromium on a running
``pgjobs run --http`` (job rows and a failing job's error as rendered, a
screenshot kept as an artifact); everything from the database escaped; no
password; a page per job; the ASGI app a FastAPI application mounts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
import warnings
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import psycopg
import pytest
from extras import binary
from fastapi import FastAPI
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url

import pgjobs
from pgjobs.operate import pause
from pgjobs.serve import Request, Source
from pgjobs.store import Store
from pgjobs.testing import run_sql
from pgjobs.web import StatusPage

with warnings.catch_warnings():
    # Starlette >= 1.x asks for httpx2 behind its test client and warns (once,
    # at import) when it finds only httpx; the client works with either.
    warnings.filterwarnings("ignore", message=r"Using `httpx` with `starlette\.testclient`")
    from fastapi.testclient import TestClient

WAIT = 60.0

SCHEMA = """
create table parent (id int primary key);
create table src (parent_id int not null references parent, k int not null, v int not null);
create table derived (parent_id int not null references parent on delete cascade,
    k int not null, v int not null, primary key (parent_id, k));
insert into parent select g from generate_series(1, 20) g;
insert into src select p, k, p * 10 + k from generate_series(1, 20) p, generate_series(1, 4) k;
"""

ERROR = "<b>boom</b> & <script>alert(1)</script>"

PLUGIN = f"""
import pgjobs

def fail(conn):
    raise RuntimeError({ERROR!r})

@pgjobs.hookimpl
def pgjobs_register_jobs(register):
    register(pgjobs.RecomputeJob(name="scores", target="derived",
        compute="select parent_id, k, v from src", every="1h"))
    register(pgjobs.QueueJob(name="worker", target="derived", scope=("parent_id",),
        compute="select parent_id, k, v from src where parent_id = any(:keys)",
        every="200ms", max_attempts=1))
    register(pgjobs.TaskJob(name="nightly-export", run=fail, every="1h", backoff="1h"))
"""

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]


def pgjobs_command() -> list[str]:
    script = Path(sys.executable).with_name("pgjobs")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pgjobs.cli"]


def chromium(tmp_path: Path, *args: str) -> str:
    """Run Debian's headless Chromium with a fresh profile; its stdout."""
    program = binary("chromium")
    profile = tmp_path / f"chromium-{time.monotonic_ns()}"
    proc = subprocess.run(
        [program, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


class DOM(HTMLParser):
    """The rows of the jobs table as the browser rendered them: per job its
    cells' text, its class, and the error shown beneath it."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.rows: dict[str, dict[str, Any]] = {}
        self.tags: list[str] = []  # every element the DOM has
        self._row: dict[str, Any] | None = None
        self._cell: list[str] | None = None
        self._in_jobs = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        self.tags.append(tag)
        if tag == "table":
            self._in_jobs = a.get("id") == "jobs"
        if not self._in_jobs:
            return
        if tag == "tr" and a.get("data-job"):
            name = a["data-job"] or ""
            row = self.rows.setdefault(name, {"cells": [], "class": "", "error": None})
            if "error" in (a.get("class") or "").split():
                self._row = {"error_of": row, "cells": []}
            else:
                row["class"] = a.get("class") or ""
                self._row = row
        elif tag == "td" and self._row is not None:
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "table":
            self._in_jobs = False
        if tag == "td" and self._row is not None and self._cell is not None:
            text = "".join(self._cell).strip()
            if "error_of" in self._row:
                self._row["error_of"]["error"] = text
            else:
                self._row["cells"].append(text)
            self._cell = None
        if tag == "tr":
            self._row = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture
def running(tmp_path: Path, engine: Engine, db_url: str) -> Iterator[tuple[str, Engine]]:
    """``pgjobs run --http ... --metrics ...`` on the test's database; the status page's URL."""
    run_sql(engine, SCHEMA)
    (tmp_path / "webjobs.py").write_text(textwrap.dedent(PLUGIN))
    (tmp_path / "pgjobs.toml").write_text('plugins = ["webjobs"]\n')
    # a password in the URL (trust auth ignores it): it must not reach the page
    url = make_url(db_url).set(password="s3cret-pw").render_as_string(hide_password=False)
    env = {**os.environ, "PGJOBS_DATABASE_URL": url}
    proc = subprocess.Popen(
        [*pgjobs_command(), "run", "--http", "127.0.0.1:0", "--metrics", "127.0.0.1:0"],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        page = metrics = None
        lines: list[str] = []
        deadline = time.monotonic() + WAIT
        assert proc.stderr is not None
        while page is None or metrics is None:
            assert time.monotonic() < deadline, "".join(lines)
            line = proc.stderr.readline()
            if not line:
                pytest.fail(f"pgjobs run exited {proc.wait()}: {''.join(lines)}")
            lines.append(line)
            if found := re.search(r"status page at (\S+)", line):
                page = found.group(1)
            if found := re.search(r"metrics at (\S+)", line):
                metrics = found.group(1)
        # the two share their address: one server serves both
        assert metrics == page.rstrip("/") + "/metrics"
        yield page, engine
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=WAIT)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()


def wait_for(engine: Engine, query: str) -> None:
    deadline = time.monotonic() + WAIT
    with engine.connect() as conn:
        while not conn.execute(text(query)).scalar():
            conn.rollback()
            assert time.monotonic() < deadline, query
            time.sleep(0.05)


def artifacts(tmp_path: Path) -> Path:
    where = os.environ.get("PGJOBS_ARTIFACTS")
    path = Path(where) if where else tmp_path / "artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.mark.needs("chromium")
def test_the_status_page_in_a_real_browser(running: tuple[str, Engine], tmp_path: Path) -> None:
    url, engine = running
    wait_for(engine, "select exists (select from pgjobs.run where job = 'scores')")
    with engine.begin() as conn:
        pgjobs.enqueue(conn, "worker", [1, 2, 3])
    wait_for(engine, "select exists (select from pgjobs.run where job = 'worker' and items = 3)")
    wait_for(engine, "select exists (select from pgjobs.run where job = 'nightly-export')")

    dom = chromium(tmp_path, "--dump-dom", url)
    parsed = DOM()
    parsed.feed(dom)
    rows = parsed.rows
    assert sorted(rows) == ["nightly-export", "scores", "worker"]
    headers = [
        "job",
        "kind",
        "group",
        "schedule",
        "outcome",
        "when",
        "next",
        "failing",
        "changed",
        "drift",
        "queue",
    ]
    cells = {name: dict(zip(headers, row["cells"], strict=True)) for name, row in rows.items()}
    assert cells["scores"] | {"when": "", "next": ""} == {
        "job": "scores",
        "kind": "recompute",
        "group": "derived",
        "schedule": "every 1h",
        "outcome": "ran",
        "when": "",
        "next": "",
        "failing": "-",
        "changed": "+80 ~0 -0",
        "drift": "-",
        "queue": "-",
    }
    assert cells["worker"]["kind"] == "queue" and cells["worker"]["outcome"] == "ran"
    assert cells["worker"]["queue"] == "0" and cells["worker"]["schedule"] == "every 200ms"
    # the failing job: its row says so, its error is shown as text (escaped), not as markup
    failing = cells["nightly-export"]
    assert failing["outcome"] == "failed" and "failing" in rows["nightly-export"]["class"]
    assert re.fullmatch(r"\d+s ago \(1\u00d7\)", failing["failing"]), failing
    assert re.fullmatch(r"in (59m\d+s|1h)", failing["next"]), failing
    assert rows["nightly-export"]["error"] == f"RuntimeError: {ERROR}"
    assert "script" not in parsed.tags and "b" not in parsed.tags
    assert "s3cret-pw" not in dom and "***@" in dom

    shot = artifacts(tmp_path) / "status-page.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1280,1000", url)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000

    # the job's own page, linked from its row
    job_dom = chromium(tmp_path, "--dump-dom", f"{url}job/nightly-export")
    assert "<h2>" in job_dom and "nightly-export" in job_dom
    assert "RuntimeError: &lt;b&gt;boom&lt;/b&gt; &amp; &lt;script&gt;" in job_dom
    # and the metrics on the same address
    with urllib.request.urlopen(f"{url}metrics", timeout=10) as response:
        body = response.read().decode()
    assert 'pgjobs_runs_total{job="worker",outcome="ran"}' in body


# -- escaping, secrets, pages: the handler itself ----------------------------------------------
HOSTILE = '<img src=x onerror="alert(1)">'


def test_everything_from_the_database_is_escaped(engine: Engine, db_url: str) -> None:
    run_sql(engine, SCHEMA)

    def fail(conn: object) -> None:
        raise RuntimeError(f"error with {HOSTILE} and </pre><script>x()</script>")

    job = pgjobs.TaskJob(name="export", run=fail, every="1h", description=f"desc {HOSTILE}")
    pgjobs.run_once(job, database=engine)
    with engine.begin() as conn:
        # a job name no definition allows, but the queue table takes any text
        pgjobs.enqueue(conn, HOSTILE, [1])
        conn.execute(
            text(
                "update pgjobs.queue set dead_at = now(), attempts = 5, last_error = :e"
                " where job = :j"
            ),
            {"e": f"parked: {HOSTILE}", "j": HOSTILE},
        )
        conn.execute(
            text(
                "insert into pgjobs.run (job, outcome, started_at, finished_at, error)"
                " values (:j, 'failed', now(), now(), :e)"
            ),
            {"j": HOSTILE, "e": f"run error {HOSTILE}"},
        )
    password_url = make_url(db_url).set(password="pw-<b>-secret")
    other = create_engine(password_url)
    try:
        source = Source(engine=other, jobs={"export": job})
        page = StatusPage()
        bodies = [
            page(source, Request("/")).body.decode(),
            page(source, Request("/job/export")).body.decode(),
            page(source, Request("/job/" + HOSTILE)).body.decode(),
        ]
    finally:
        other.dispose()
    escaped = "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;"
    for body in bodies:
        for raw in ("<img", "<script", "</pre><script"):
            assert raw not in body, (raw, body[max(body.find(raw) - 200, 0) : body.find(raw) + 80])
        assert escaped in body
        assert "pw-" not in body and "secret" not in body
    overview = bodies[0]
    assert f"RuntimeError: error with {escaped} and &lt;/pre&gt;&lt;script&gt;x()" in overview
    assert f"parked: {escaped}" in overview  # the dead item's last error
    assert f"run error {escaped}" in overview
    assert f"desc {escaped}" in bodies[1]
    # the link to the hostile job's page is quoted, not markup
    assert 'href="/job/%3Cimg%20src%3Dx%20onerror%3D%22alert%281%29%22%3E"' in overview


def test_each_job_has_a_page_and_an_unknown_one_is_404(engine: Engine) -> None:
    run_sql(engine, SCHEMA)
    jobs = [
        pgjobs.RecomputeJob(
            name="scores", target="derived", compute="select parent_id, k, v from src", every="1h"
        ),
        pgjobs.TaskJob(name="other", run=lambda conn: None, every="1h"),
    ]
    for job in jobs:
        pgjobs.run_once(job, database=engine)
    pause(engine, Store(), jobs[1], reason="backfill")
    assert pgjobs.run_once(jobs[1], database=engine).outcome == "paused"  # a quiet tick
    source = Source(engine=engine, jobs={j.name: j for j in jobs})
    page = StatusPage(refresh=0)
    response = page(source, Request("/job/scores", base="/ops"))
    assert response.status == 200 and response.content_type.startswith("text/html")
    body = response.body.decode()
    assert 'data-job="scores"' in body and 'data-job="other"' not in body
    assert 'href="/ops/#job-scores"' in body  # back to the job's row on the overview
    assert 'http-equiv="refresh"' not in body
    overview = page(source, Request("/", base="/ops")).body.decode()
    assert 'href="/ops/job/scores"' in overview and 'id="job-scores"' in overview
    # the row under a paused job spans the whole jobs table, as its header does
    jobs_table = re.search(r'<table id="jobs">.*?</table>', overview, re.S)
    assert jobs_table is not None, overview
    headers = len(re.findall(r"<th[ >]", jobs_table.group(0)))
    spans = re.findall(r'<tr class="paused"[^>]*><td colspan="(\d+)"', jobs_table.group(0))
    assert headers == 11 and spans == [str(headers)], (headers, spans)
    # the job's page counts its paused ticks with its other quiet ones
    other = page(source, Request("/job/other")).body.decode()
    assert "0 backing off, 1 paused" in other, other
    assert page(source, Request("/job/nope")).status == 404
    assert page(source, Request("/nope")).status == 404


def test_a_fastapi_app_mounts_the_page_and_it_finds_the_lifespan_s_scheduler(
    engine: Engine,
) -> None:
    run_sql(engine, SCHEMA)
    job = pgjobs.RecomputeJob(
        name="scores", target="derived", compute="select parent_id, k, v from src", every="1h"
    )
    app = FastAPI(lifespan=pgjobs.lifespan(pgjobs.Scheduler([job], engine)))
    app.mount("/pgjobs", pgjobs.web.asgi_app())
    with TestClient(app) as client:
        response = client.get("/pgjobs/")
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/html; charset=utf-8"
        assert 'href="/pgjobs/job/scores"' in response.text
        assert 'http-equiv="refresh" content="5"' in response.text
        assert client.get("/pgjobs/job/scores").status_code == 200
        assert client.head("/pgjobs/").text == ""
        assert client.post("/pgjobs/").status_code == 405


def test_without_a_scheduler_the_app_says_what_is_missing() -> None:
    app = FastAPI()
    app.mount("/pgjobs", pgjobs.web.asgi_app())
    with TestClient(app) as client:
        response = client.get("/pgjobs/")
    assert response.status_code == 503 and "pgjobs.lifespan" in response.text


def test_the_fastapi_example_mounts_the_page(db_url: str) -> None:
    import importlib.util
    import uuid

    example = Path(__file__).resolve().parent.parent / "examples" / "fastapi_app"
    libpq = db_url.replace("postgresql+psycopg://", "postgresql://", 1)
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute((example / "schema.sql").read_text(encoding="utf-8").encode())
    name = f"example_fastapi_{uuid.uuid4().hex[:8]}"
    spec = importlib.util.spec_from_file_location(name, example / "app.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        with TestClient(module.create_app(db_url)) as client:
            response = client.get("/pgjobs/")
            assert response.status_code == 200
            assert 'data-job="author-stats"' in response.text
            assert 'href="/pgjobs/job/author-stats"' in response.text
    finally:
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("option", "address", "message"),
    [
        (
            "--http",
            "localhost:http",
            "--http: expected HOST:PORT (a port 0-65535), got 'localhost:http'",
        ),
        (
            "--metrics",
            "127.0.0.1:70000",
            "--metrics: expected HOST:PORT (a port 0-65535), got '127.0.0.1:70000'",
        ),
        (
            "--http",
            "::1:8080",
            "--http: write an IPv6 address in brackets ([::1]:9100), got '::1:8080'",
        ),
        ("--http", "a b:80", "--http: 'a b' is not a host name or address, in 'a b:80'"),
    ],
)
def test_a_bad_address_exits_2_naming_the_option_and_value(
    option: str, address: str, message: str
) -> None:
    from click.testing import CliRunner

    from pgjobs.cli import cli

    result = CliRunner().invoke(cli, ["run", option, address], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert result.stderr == f"pgjobs: error: {message}\n"


def test_addresses() -> None:
    from pgjobs.serve import parse_address

    assert parse_address("9100") == ("127.0.0.1", 9100)
    assert parse_address(":9100") == ("127.0.0.1", 9100)
    assert parse_address("0.0.0.0:9100") == ("0.0.0.0", 9100)
    assert parse_address("[::1]:0") == ("::1", 0)
    assert parse_address("localhost:8080") == ("localhost", 8080)
