"""Running pgjobs' scheduler with a FastAPI/Starlette app: :func:`lifespan`.

    app = FastAPI(lifespan=pgjobs.lifespan("pgjobs.toml"))

The scheduler starts with the app and shuts down with it, off the event
loop (its shutdown waits for the running transactions).
"""

from __future__ import annotations

import asyncio
import os
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .scheduler import Scheduler

if TYPE_CHECKING:
    from .config import Config


class Lifespan:
    """An async context manager that starts a :class:`Scheduler` and shuts
    it down; also callable with an app, as FastAPI's ``lifespan=`` wants.

    It yields ``{"pgjobs": scheduler}``: Starlette puts that in the lifespan
    state, so request handlers find the scheduler as ``request.state.pgjobs``.
    """

    def __init__(
        self, target: Scheduler | Config | str | os.PathLike[str] | None, options: dict[str, Any]
    ) -> None:
        self._target = target
        self._options = options
        self.scheduler: Scheduler | None = None

    def __call__(self, app: object) -> Lifespan:
        return self

    async def __aenter__(self) -> dict[str, Scheduler]:
        if isinstance(self._target, Scheduler):
            scheduler = self._target
        else:
            scheduler = await asyncio.to_thread(
                Scheduler.from_config, self._target, **self._options
            )
        await scheduler.__aenter__()
        self.scheduler = scheduler
        return {"pgjobs": scheduler}

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        scheduler, self.scheduler = self.scheduler, None
        if scheduler is not None:
            await scheduler.__aexit__(exc_type, exc, tb)


def lifespan(
    scheduler_or_config: Scheduler | Config | str | os.PathLike[str] | None = None, **options: Any
) -> Lifespan:
    """A FastAPI/Starlette lifespan that runs pgjobs' scheduler with the app::

        app = FastAPI(lifespan=pgjobs.lifespan("pgjobs.toml"))
        # or: async with pgjobs.lifespan(scheduler): ...

    ``scheduler_or_config``: a :class:`Scheduler`, or what
    :meth:`Scheduler.from_config` takes (``options`` go to it:
    ``entry_points=["exams"]`` loads only that installed plugin,
    ``entry_points=[]`` none, whatever else is installed). Installs no
    signal handler; shutdown waits for the running transaction, off the event loop.
    """
    return Lifespan(scheduler_or_config, options)


__all__ = ["Lifespan", "lifespan"]
