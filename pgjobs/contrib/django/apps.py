"""The app's config: label ``pgjobs`` (the admin's ``/admin/pgjobs/``), its
system check registered when Django is ready."""

from __future__ import annotations

from django.apps import AppConfig


class PgJobsConfig(AppConfig):
    name = "pgjobs.contrib.django"
    label = "pgjobs"
    verbose_name = "pgjobs"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.core import checks

        from .checks import schema_check

        checks.register(schema_check, "pgjobs")


__all__ = ["PgJobsConfig"]
