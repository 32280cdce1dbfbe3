"""The status page's HTML, built from pieces that escape what they are
given (:func:`el`, :func:`esc`: every value from the database or a job's
definition goes through them), and its style sheet. :mod:`pgjobs.web`
composes the page with them."""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import Any


class Markup(str):
    """Text that is HTML already (everything else is escaped)."""


def esc(value: Any) -> Markup:
    if isinstance(value, Markup):
        return value
    return Markup(html.escape("" if value is None else str(value), quote=True))


def el(tag: str, *children: Any, **attrs: Any) -> Markup:
    """``el("a", "x<y", href="/j")`` -> ``<a href="/j">x&lt;y</a>``; ``class_=``
    for ``class``; ``None`` children and attributes are left out."""
    parts = [tag]
    for key, value in attrs.items():
        if value is None or value is False:
            continue
        name = key.rstrip("_").replace("_", "-")
        parts.append(name if value is True else f'{name}="{esc(value)}"')
    inner = Markup("").join(_flat(children))
    if tag in ("meta", "link", "br"):
        return Markup(f"<{' '.join(parts)}>")
    return Markup(f"<{' '.join(parts)}>{inner}</{tag}>")


def _flat(children: Iterable[Any]) -> Iterable[Markup]:
    for child in children:
        if child is None:
            continue
        if isinstance(child, list | tuple):
            yield from _flat(child)
        else:
            yield esc(child)


CSS = """
:root { --ran: #2f9e44; --failed: #e03131; --quiet: #adb5bd; --compute: #4c6ef5;
  --write: #74c0fc; --locks: #f08c00; --other: #dee2e6; }
body { font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0;
  color: #212529; background: #f8f9fa; }
header { background: #212529; color: #f8f9fa; padding: 10px 20px; display: flex; gap: 20px;
  align-items: baseline; flex-wrap: wrap; }
header h1 { font-size: 18px; margin: 0; } header a { color: #f8f9fa; }
header .meta { color: #ced4da; font-size: 12px; }
main { padding: 10px 20px 40px; max-width: 1400px; }
h2 { font-size: 15px; margin: 22px 0 6px; }
table { border-collapse: collapse; width: 100%; background: #fff; box-shadow: 0 1px 2px #0001; }
th, td { text-align: left; padding: 5px 8px; border-bottom: 1px solid #e9ecef;
  vertical-align: top; white-space: nowrap; }
th { background: #f1f3f5; font-weight: 600; font-size: 12px; color: #495057; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.wrap { white-space: normal; }
.outcome { display: inline-block; padding: 0 6px; border-radius: 8px; font-size: 12px;
  color: #fff; background: var(--quiet); }
.outcome.ran { background: var(--ran); } .outcome.failed { background: var(--failed); }
tr.failing td { background: #fff5f5; }
tr.error td { background: #fff5f5; padding-top: 0; }
.outcome.paused { background: #f08c00; } tr.paused td { background: #fff9db; padding-top: 0; }
.error pre, pre.error { white-space: pre-wrap; word-break: break-word; margin: 0;
  font: 12px/1.4 ui-monospace, SFMono-Regular, Menlo, monospace; color: #c92a2a; }
.muted { color: #868e96; }
p.warning { background: #fff9db; border-left: 4px solid #f08c00; padding: 8px 10px; margin: 10px 0; }
.bar { display: flex; width: 260px; height: 12px; background: var(--other); border-radius: 2px;
  overflow: hidden; }
.bar span { display: block; height: 100%; }
.bar .compute { background: var(--compute); } .bar .write { background: var(--write); }
.bar .locks { background: var(--locks); min-width: 2px; }
.legend span { display: inline-block; width: 10px; height: 10px; margin: 0 4px 0 12px;
  vertical-align: -1px; }
svg.timeline { width: 100%; background: #fff; box-shadow: 0 1px 2px #0001; }
svg.timeline text { font: 11px system-ui, sans-serif; fill: #495057; }
svg.timeline .ran { fill: var(--ran); } svg.timeline .failed { fill: var(--failed); }
svg.timeline line { stroke: #e9ecef; }
dl { display: grid; grid-template-columns: max-content auto; gap: 2px 16px; background: #fff;
  padding: 10px; box-shadow: 0 1px 2px #0001; margin: 0; } dt { color: #868e96; }
"""


__all__ = ["CSS", "Markup", "el", "esc"]
