"""How a drift check reads (:mod:`pgjobs.drift`): the summary that
``pgjobs check`` and :func:`pgjobs.testing.assert_no_drift` print, and the
keys of ``pgjobs check --keys`` as typed on a command line."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .drift import KINDS, ON_THE_WAY, CheckResult, Sample
from .errors import ConfigError


def parse_keys(values: Sequence[str]) -> list[Any]:
    """``pgjobs check --keys``: each value a JSON array for a composite scope
    (``'[7, "b"]'``), else the value as it is (its column's type reads it)."""
    out: list[Any] = []
    for value in values:
        text = value.strip()
        if text.startswith("["):
            try:
                parsed = json.loads(text)
            except ValueError as exc:
                raise ConfigError(f"--keys: {value!r} is not a JSON array: {exc}") from None
            if not isinstance(parsed, list):
                raise ConfigError(f"--keys: expected a JSON array, got {value!r}")
            out.append(tuple(parsed))
        else:
            out.append(value)
    return out


def summary(result: CheckResult) -> str:
    """What ``pgjobs check`` prints: a line of figures, then the samples."""
    w = result.on_the_way
    lines = [result.headline()]
    if w.changed or w.skipped_missing_parent:
        lines.append(
            f"  on their way (items queued or in flight, not drift): insert {w.inserted:,},"
            f" update {w.updated:,}, delete {w.deleted:,}, skip {w.skipped_missing_parent:,}"
        )
    for kind in (*KINDS, ON_THE_WAY):
        for item in result.samples.get(kind, ()):
            lines.append(f"  {kind}: {_row_text(item)}")
    return "\n".join(lines)


def _row_text(item: Sample) -> str:
    def text(values: Mapping[str, Any] | None) -> str:
        return json.dumps(dict(values or {}), default=str)

    key = text(item.key)
    if item.old is not None and item.new is not None:
        changed = item.changed or tuple(item.new)
        old = {c: item.old[c] for c in changed}
        new = {c: item.new[c] for c in changed}
        return f"{key} {text(old)} -> {text(new)}"
    if item.new is not None:
        return f"{key} new {text(item.new)}"
    return f"{key} old {text(item.old)}"


__all__ = ["parse_keys", "summary"]
