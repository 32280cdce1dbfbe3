"""The admin, under the app's label (``/admin/pgjobs/``), read-only:

* **jobs**: every job's last outcome, next attempt, failures, rows changed,
  queue depth, pause and last drift check (``pgjobs status``'s rows), with
  the actions pause, resume, run once, check drift and revive;
* **runs**: the runs recorded, newest first;
* **queues**: each queue job's depth, retrying and dead items, and the
  dead items themselves.

Seeing them takes ``pgjobs.view_*`` (staff only: the admin lets no one
else in); the actions take ``pgjobs.operate``. They are the ``pgjobs``
command's own (:class:`pgjobs.operate.Operator`, :func:`pgjobs.run_once`,
:func:`pgjobs.check`), on an engine of pgjobs' own.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.views.decorators.http import require_POST

from .models import JobState, QueueItem, Run

OPERATE = "pgjobs.operate"
ACTIONS = ("pause", "resume", "once", "check", "revive")


class _ReadOnly(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def _status() -> tuple[list[dict[str, Any]], Any]:
    """``pgjobs status``'s rows (its own code), each with the job's kind."""
    from ...cli.reading import _status as status_rows
    from .conf import load
    from .host import preset

    given = preset(load())
    registry = given.registry(given.config)
    rows, now, _, _ = status_rows(registry, given.config, given.url)
    for row in rows:
        row["kind"] = registry.get(row["job"]).kind if row["registered"] else ""
    return rows, now


def act(action: str, job: str, keys: list[str], *, by: str = "") -> str:
    """One action of the admin on ``job``: the line the command would print
    (``by``: who, for a pause's reason)."""
    from ... import api
    from ...operate import Operator
    from .conf import load
    from .host import engine, preset

    settings = load()
    given = preset(settings)
    registry = given.registry(given.config)
    operator = Operator(given.config, registry, given.url)
    if action == "pause":
        return operator.pause(job, reason=f"from the Django admin{f' by {by}' if by else ''}")
    if action == "resume":
        return operator.resume(job)
    if action == "revive":
        return operator.revive(job, keys, as_json=True)
    if action == "once":
        from ...cli.ticking import _summary

        with engine(settings) as made:
            result = api.run_once(
                registry.get(job),
                made,
                namespace=given.config.namespace,
                schema=given.config.schema,
                force=True,
                auto_migrate=given.config.auto_migrate,
            )
        return f"pgjobs: {_summary(result)}"
    assert action == "check", action
    with engine(settings) as made:
        found = api.check(registry.get(job), made, schema=given.config.schema)
    return f"pgjobs: {found.headline()}"  # the first line of `pgjobs check`


class _Operated(_ReadOnly):
    """A page of pgjobs' own in place of the change list, and its actions' URL."""

    template: str = ""

    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}_act"
        own = [path("act/", self.admin_site.admin_view(self.act_view), name=name)]
        urls: list[URLPattern] = super().get_urls()
        return own + urls

    def page(self, request: HttpRequest) -> dict[str, Any]:
        raise NotImplementedError

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": self.opts.verbose_name_plural.capitalize(),
            "can_operate": request.user.has_perm(OPERATE),
            "act_url": reverse(
                f"admin:{self.opts.app_label}_{self.opts.model_name}_act",
                current_app=self.admin_site.name,
            ),
        }
        try:
            context.update(self.page(request))
        except Exception as exc:  # the page says what went wrong, the admin stays up
            context["failure"] = f"{type(exc).__name__}: {exc}"
        return TemplateResponse(request, self.template, context)

    def act_view(self, request: HttpRequest) -> HttpResponse:
        return require_POST(self._act)(request)

    def _act(self, request: HttpRequest) -> HttpResponse:
        if not request.user.has_perm(OPERATE):
            raise PermissionDenied
        action, job = request.POST.get("action", ""), request.POST.get("job", "")
        if action not in ACTIONS or not job:
            messages.error(request, f"pgjobs: no action {action!r} on job {job!r}")
        else:
            try:
                line = act(action, job, request.POST.getlist("key"), by=str(request.user))
                messages.success(request, line)
            except Exception as exc:
                messages.error(request, f"pgjobs: {action} {job}: {type(exc).__name__}: {exc}")
        changelist = f"admin:{self.opts.app_label}_{self.opts.model_name}_changelist"
        return HttpResponseRedirect(reverse(changelist, current_app=self.admin_site.name))


@admin.register(JobState)
class JobAdmin(_Operated):
    template = "admin/pgjobs/jobs.html"

    def page(self, request: HttpRequest) -> dict[str, Any]:
        from ...operate import check_line

        rows, now = _status()
        for row in rows:
            row["check_line"] = check_line(row["last_check"], now) if row["last_check"] else ""
            changed = row["rows_changed"]
            row["changed_line"] = (
                ""
                if changed is None
                else f"+{changed['inserted']:,} ~{changed['updated']:,} -{changed['deleted']:,}"
            )
        return {"rows": rows, "now": now}


@admin.register(QueueItem)
class QueueAdmin(_Operated):
    template = "admin/pgjobs/queues.html"
    shown = 200

    def page(self, request: HttpRequest) -> dict[str, Any]:
        from .conf import load

        rows, _ = _status()
        queues = [r for r in rows if r["queue"] is not None and r["registered"]]
        dead = (
            QueueItem.objects.using(load().using)
            .filter(dead_at__isnull=False)
            .order_by("-dead_at")[: self.shown]
        )
        return {"queues": queues, "dead": [_dead_row(d) for d in dead], "shown": self.shown}


def _dead_row(item: QueueItem) -> dict[str, Any]:
    import json

    text = json.dumps(item.key, separators=(",", ":"))
    return {"item": item, "key_json": text, "keys": [text]}


@admin.register(Run)
class RunAdmin(_ReadOnly):
    list_display = (
        "job",
        "outcome",
        "started_at",
        "finished_at",
        "inserted",
        "updated",
        "deleted",
        "items",
        "failed_items",
        "error",
    )
    list_filter = ("outcome", "job")
    search_fields = ("job", "error")
    date_hierarchy = None
    show_full_result_count = False

    def get_queryset(self, request: HttpRequest) -> Any:
        from .conf import load

        return super().get_queryset(request).using(load().using)


__all__ = ["ACTIONS", "OPERATE", "JobAdmin", "QueueAdmin", "RunAdmin", "act"]
