"""What pgjobs sends, as tests see it: every statement of a round trip
(:func:`pgjobs._wire.round_trip`, how :func:`pgjobs._pg.send` sends) and of
psycopg's own ``Connection.execute`` (the other paths), with its parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from pgjobs import _wire


def text_of(statement: Any, conn: Any = None) -> str:
    """A statement's text: a string as it is, composed SQL rendered."""
    return statement if isinstance(statement, str) else statement.as_string(conn)


def spy(
    monkeypatch: pytest.MonkeyPatch,
    seen: Callable[[psycopg.Connection[Any], str, Any], None],
    *,
    execute: bool = True,
) -> None:
    """Call ``seen(connection, text, params)`` for each statement sent from
    now on (the round trips; and ``Connection.execute``, unless ``execute``
    is false), until the test ends."""
    round_trip = _wire.round_trip

    def sent(raw: psycopg.Connection[Any], statements: Any, **kwargs: Any) -> Any:
        for statement, params in statements:
            seen(raw, text_of(statement, raw), params)
        return round_trip(raw, statements, **kwargs)

    monkeypatch.setattr(_wire, "round_trip", sent)
    if execute:
        plain = psycopg.Connection.execute

        def executed(self: psycopg.Connection[Any], query: Any, *args: Any, **kw: Any) -> Any:
            seen(self, text_of(query, self), args[0] if args else kw.get("params"))
            return plain(self, query, *args, **kw)

        monkeypatch.setattr(psycopg.Connection, "execute", executed)


def texts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A list that fills with the text of each statement sent from now on."""
    out: list[str] = []
    spy(monkeypatch, lambda _raw, text, _params: out.append(text))
    return out
