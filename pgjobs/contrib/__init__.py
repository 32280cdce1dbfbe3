"""pgjobs inside other frameworks: each a folder of its own that uses
pgjobs' public API (and its CLI), imported only by applications that ask
for it. ``pgjobs.contrib.django``: the Django app."""

from __future__ import annotations

__all__: list[str] = []
