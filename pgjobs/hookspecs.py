"""The hooks a pgjobs plugin may implement.

A plugin is a module (or any object) with functions decorated with
:data:`hookimpl` and named after a spec below. pgjobs finds plugins in the
``pgjobs`` entry-point group of installed packages, and in the modules a
config file lists under ``plugins``::

    # pyproject.toml of your package
    [project.entry-points.pgjobs]
    scores = "myapp.jobs"

    # myapp/jobs.py
    import pgjobs

    @pgjobs.hookimpl
    def pgjobs_register_jobs(register):
        register(pgjobs.RecomputeJob(name="exam-scores", target="exam_score", compute=SQL))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .jobs import Job

PROJECT = "pgjobs"

#: Marks a hook *specification* (pgjobs itself uses it, in this module only).
hookspec = pluggy.HookspecMarker(PROJECT)
#: Marks a plugin's hook *implementation*: ``@pgjobs.hookimpl``.
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def pgjobs_register_jobs(register: Callable[[Job], None]) -> None:
    """Register the plugin's jobs by calling ``register(job)`` once per job.

    ``job`` is a :class:`~pgjobs.RecomputeJob`, :class:`~pgjobs.QueueJob` or
    :class:`~pgjobs.TaskJob`. pgjobs validates each registration when it is
    made: a job name already registered by another plugin (or declared in the
    config file) is refused with an error naming both owners, and so are two
    jobs that write the same target table from different groups. pgjobs
    remembers which plugin registered each job (``pgjobs list`` shows it).

    The hook runs once, when the registry is built; it should only build job
    objects, not touch the database. An exception here is a
    :class:`~pgjobs.PluginError` naming the plugin.
    """


__all__ = [
    "PROJECT",
    "hookimpl",
    "hookspec",
    "pgjobs_register_jobs",
]
