"""Unmanaged models over pgjobs' own tables, for the admin (read-only):
each job's state, its runs, the queue. pgjobs' migrations make the tables
(``operations.ApplyMigration``); Django never creates, alters or drops
them. The schema is ``PGJOBS["schema"]`` (default ``pgjobs``) when the
models are imported."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models

from ...store import DEFAULT_SCHEMA


def _table(name: str) -> str:
    # Django quotes a db_table whole: "schema"."table" comes out of this
    schema = getattr(settings, "PGJOBS", {}).get("schema", DEFAULT_SCHEMA)
    return f'{schema}"."{name}'


class JobState(models.Model):
    """``<schema>.job_state``: one row per job that has run."""

    job = models.TextField(primary_key=True)
    next_attempt_at = models.DateTimeField(null=True)
    failures = models.IntegerField()
    last_started_at = models.DateTimeField(null=True)
    last_success_at = models.DateTimeField(null=True)
    last_failure_at = models.DateTimeField(null=True)
    last_error = models.TextField(null=True)
    last_sqlstate = models.TextField(null=True)
    paused_at = models.DateTimeField(null=True)
    paused_reason = models.TextField(null=True)
    paused_by = models.TextField(null=True)
    updated_at = models.DateTimeField()

    class Meta:
        managed = False
        db_table = _table("job_state")
        verbose_name = "job"
        default_permissions = ("view",)
        permissions = [("operate", "Can pause, resume, run once and revive pgjobs' jobs")]

    def __str__(self) -> str:
        return str(self.job)


class Run(models.Model):
    """``<schema>.run``: one row per tick that did something (or failed)."""

    id = models.BigAutoField(primary_key=True)
    job = models.TextField()
    outcome = models.TextField()
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField()
    inserted = models.BigIntegerField()
    updated = models.BigIntegerField()
    deleted = models.BigIntegerField()
    items = models.IntegerField()
    failed_items = models.IntegerField()
    error = models.TextField(null=True)
    sqlstate = models.TextField(null=True)
    worker = models.TextField(null=True)

    class Meta:
        managed = False
        db_table = _table("run")
        default_permissions = ("view",)
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return f"{self.job} {self.outcome} at {self.started_at:%Y-%m-%d %H:%M:%S}"


class QueueItem(models.Model):
    """``<schema>.queue``: one row per (job, key) queued, retrying or dead.

    Its key is (job, key), which the admin cannot register (Django 5.2
    refuses a ``CompositePrimaryKey`` there): ``job`` stands in as the
    model's primary key. Read rows only in lists (``filter()``, ``values()``);
    never ``get(pk=...)``, ``save()`` or ``delete()`` (the admin's pages are
    its own, with no change form)."""

    job = models.TextField(primary_key=True)
    key = models.JSONField()
    enqueued_at = models.DateTimeField()
    attempts = models.IntegerField()
    not_before = models.DateTimeField()
    last_error = models.TextField(null=True)
    dead_at = models.DateTimeField(null=True)

    class Meta:
        managed = False
        db_table = _table("queue")
        verbose_name = "queue"
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.job} {self.key}"


def model_states() -> list[Any]:
    """``CreateModel`` operations giving the migration state the models as
    this file has them: the first migration holds them, so that
    ``makemigrations`` finds nothing to add however they change (no table
    is ever made from them)."""
    from django.db.migrations import CreateModel
    from django.db.migrations.state import ModelState

    out = []
    for model in (JobState, Run, QueueItem):
        state = ModelState.from_model(model)
        out.append(
            CreateModel(
                name=state.name,
                fields=list(state.fields.items()),
                options=state.options,
                bases=state.bases,
                managers=state.managers,
            )
        )
    return out


__all__ = ["JobState", "QueueItem", "Run", "model_states"]
