"""What the status page and the metrics read from, and how they are served.

* :class:`Source`: a database, pgjobs' schema in it, and the jobs to show
  (a running :class:`~pgjobs.Scheduler` has all three: :meth:`Source.of`).
* :func:`asgi` turns a handler into a plain ASGI app (no framework), for
  FastAPI's ``app.mount(...)``; with no source given, it finds the
  scheduler that :func:`pgjobs.lifespan` put in the lifespan state.
* :func:`serve` runs WSGI apps on an address in a background thread, with
  the standard library's ``wsgiref`` (``pgjobs run --http/--metrics``).

A handler is ``(source, path, query) -> Response``, synchronous (it reads
the database); the ASGI adapter runs it in a thread, off the event loop.

Why the standard library: the page and a scrape every few seconds need no
more, pgjobs gains no dependency, and the CLI is a synchronous process
whose scheduler already runs in threads (``prometheus_client`` serves its
own ``start_http_server`` the same way).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import timedelta
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from .errors import ConfigError, PgJobsError
from .horizon import HORIZON_WARNING

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from .jobs import Job
    from .scheduler import Scheduler

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


@dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    """Where the page and the metrics read: ``engine``, pgjobs' ``schema``
    and the ``jobs`` to show (in order; jobs found only in the database are
    shown after them)."""

    engine: Engine
    schema: str = "pgjobs"
    jobs: Mapping[str, Job] = field(default_factory=dict)
    #: the page warns of a snapshot or transaction held longer (``horizon_warning``)
    horizon_warning: timedelta = HORIZON_WARNING

    @classmethod
    def of(cls, target: Scheduler | Source) -> Source:
        """The source of a running scheduler (its engine, schema and jobs)."""
        if isinstance(target, Source):
            return target
        runner = getattr(target, "runner", None)
        jobs = getattr(target, "jobs", None)
        if runner is None or not isinstance(jobs, Mapping):
            raise PgJobsError(f"expected a pgjobs.Scheduler or a Source, got {target!r}")
        return cls(
            engine=runner.engine,
            schema=runner.store.schema,
            jobs=dict(jobs),
            horizon_warning=getattr(target, "horizon_warning", HORIZON_WARNING),
        )

    def database_label(self) -> str:
        """The database as a person reads it, without a password."""
        url = self.engine.url
        return url.set(drivername=url.get_backend_name()).render_as_string(hide_password=True)


@dataclass(frozen=True, slots=True)
class Request:
    """What a handler is asked: ``path`` below the app's mount point,
    ``query`` (parsed), and ``base``, the mount point (``""`` at the root),
    for links."""

    path: str
    query: Mapping[str, list[str]] = field(default_factory=dict)
    base: str = ""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[Source, Request], Response]

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


def _no_source() -> Response:
    return Response(
        503,
        b"pgjobs: no scheduler to read from: pass one (or a Source) to the app, or run the"
        b" application under pgjobs.lifespan(...)\n",
    )


def _headers(response: Response) -> list[tuple[str, str]]:
    return [
        ("Content-Type", response.content_type),
        ("Content-Length", str(len(response.body))),
        ("Cache-Control", "no-store"),
        ("X-Content-Type-Options", "nosniff"),
        *response.headers,
    ]


class _Resolver:
    """The source of an app: given, or found on the first request."""

    def __init__(
        self, source: Scheduler | Source | None, on_source: Callable[[Any], object] | None
    ) -> None:
        self._given = source
        self._source = None if source is None else Source.of(source)
        self._on_source = on_source
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        if source is not None:
            self._notify(source)

    def _notify(self, target: Any) -> None:
        if self._on_source is None:
            return
        with self._lock:
            if id(target) in self._seen:
                return
            self._seen.add(id(target))
        self._on_source(target)

    def resolve(self, state: Mapping[str, Any] | None) -> Source | None:
        if self._source is not None:
            return self._source
        found = (state or {}).get("pgjobs")
        if found is None:
            return None
        self._notify(found)
        return Source.of(found)


def asgi(
    handler: Handler,
    source: Scheduler | Source | None = None,
    *,
    on_source: Callable[[Any], object] | None = None,
) -> ASGIApp:
    """A plain ASGI app serving ``handler`` (GET and HEAD).

    ``source``: a scheduler or a :class:`Source`; ``None`` finds the
    scheduler in the lifespan state (``{"pgjobs": scheduler}``, what
    :func:`pgjobs.lifespan` yields) of each request. ``on_source`` is called
    once with each scheduler found (the metrics bind to it).
    """
    resolver = _Resolver(source, on_source)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # served alone, not mounted: nothing to start
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        if scope.get("method", "GET") not in ("GET", "HEAD"):
            response = Response(405, b"read-only: GET or HEAD\n", headers=(("Allow", "GET, HEAD"),))
        else:
            found = resolver.resolve(scope.get("state"))
            if found is None:
                response = _no_source()
            else:
                path = scope.get("path", "/")
                root = scope.get("root_path", "").rstrip("/")
                if root and (path == root or path.startswith(root + "/")):
                    path = path[len(root) :]  # Starlette keeps the mount in path
                query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
                request = Request(path or "/", query, root)
                response = await asyncio.to_thread(handler, found, request)
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [(k.lower().encode(), v.encode()) for k, v in _headers(response)],
            }
        )
        body = b"" if scope.get("method") == "HEAD" else response.body
        await send({"type": "http.response.body", "body": body})

    return app


def wsgi(handler: Handler, source: Scheduler | Source) -> WSGIApp:
    """A WSGI app serving ``handler`` on ``source`` (GET and HEAD)."""
    found = Source.of(source)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        if method not in ("GET", "HEAD"):
            response = Response(405, b"read-only: GET or HEAD\n", headers=(("Allow", "GET, HEAD"),))
        else:
            request = Request(
                environ.get("PATH_INFO", "/") or "/",
                parse_qs(environ.get("QUERY_STRING", "")),
                environ.get("SCRIPT_NAME", "").rstrip("/"),
            )
            response = handler(found, request)
        reason = _REASONS.get(response.status, "")
        start_response(f"{response.status} {reason}", _headers(response))
        return [b""] if method == "HEAD" else [response.body]

    return app


# -- a server of the standard library's ----------------------------------------------
def parse_address(value: str, *, option: str = "address") -> tuple[str, int]:
    """``"127.0.0.1:9100"``, ``"[::1]:9100"``, ``"0.0.0.0:9100"``, ``"localhost:8080"``;
    ``"9100"`` and ``":9100"`` mean 127.0.0.1 (this machine only). Port 0
    picks a free port."""
    text = value.strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(
            f"{option}: write an IPv6 address in brackets ([::1]:9100), got {value!r}"
        )
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{option}: expected HOST:PORT (a port 0-65535), got {value!r}")
    if host and not _host_name_ok(host):
        raise ConfigError(f"{option}: {host!r} is not a host name or address, in {value!r}")
    return host or "127.0.0.1", int(port)


def _host_name_ok(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        labels = host.split(".")
        return all(label and len(label) <= 63 for label in labels) and all(
            c.isalnum() or c == "-" for c in host.replace(".", "")
        )


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """Requests go to pgjobs' logger at DEBUG, not to stderr one by one."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class Server:
    """WSGI apps by path prefix, served on one address in a daemon thread."""

    def __init__(self, address: tuple[str, int], routes: Mapping[str, WSGIApp]) -> None:
        host, port = address
        self.routes = dict(sorted(routes.items(), key=lambda r: -len(r[0])))
        server_class = _Server6 if ":" in host else _Server
        try:
            self._httpd = make_server(
                host, port, self._app, server_class=server_class, handler_class=_QuietHandler
            )
        except OSError as exc:
            raise PgJobsError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name=f"pgjobs-http-{self.address[1]}", daemon=True
        )

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/") or "/"
        for prefix, app in self.routes.items():
            mount = prefix.rstrip("/")
            if not mount or path == mount or path.startswith(mount + "/"):
                inner = dict(environ)
                inner["SCRIPT_NAME"] = environ.get("SCRIPT_NAME", "") + mount
                inner["PATH_INFO"] = path[len(mount) :] or "/"
                return app(inner, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"not found: {path}; try {', '.join(self.routes)}\n".encode()]

    def start(self) -> Server:
        """Serve in the background (again: nothing)."""
        if not self._thread.is_alive():
            self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(address: tuple[str, int], routes: Mapping[str, WSGIApp]) -> Server:
    """Start serving ``routes`` (path prefix -> WSGI app) on ``address``."""
    return Server(address, routes).start()


__all__ = ["Request", "Response", "Server", "Source", "asgi", "parse_address", "serve", "wsgi"]
