"""Derived tables declared once: one SQL text and its sources.

``[derived.NAME]`` in ``pgjobs.toml`` (or :class:`Derived` in Python)
declares a derived table: its target, scope, whole contents as one SQL
text, the recompute's schedule and its sources, each mapped to keys. From
it pgjobs makes:

* the recompute job ``NAME`` and the queue job ``NAME:queue``, whose
  keyed compute is the SQL restricted to a batch's keys
  (:mod:`~pgjobs.derived.declare`, :mod:`~pgjobs.derived.keyed`);
* statement-level triggers on every source that enqueue the keys a
  user's statement touched, in the user's transaction, installed by
  ``pgjobs migrate`` (:mod:`~pgjobs.derived.triggers`).

A derived table may be another's source (a chain); a cycle is refused.
Why: ``docs/DESIGN.md``, "Derived tables"; how: ``docs/how-to/derived.md``.
"""

from __future__ import annotations

from .declare import QUEUE_SUFFIX, Derived, Source, chain_order, same_table
from .keyed import keyed_sql
from .triggers import (
    TriggerPlan,
    check_declared,
    check_one,
    install_triggers,
    plan_triggers,
    read_plan,
    reads,
    script,
)

__all__ = [
    "QUEUE_SUFFIX",
    "Derived",
    "Source",
    "TriggerPlan",
    "chain_order",
    "check_declared",
    "check_one",
    "install_triggers",
    "keyed_sql",
    "plan_triggers",
    "read_plan",
    "reads",
    "same_table",
    "script",
]
