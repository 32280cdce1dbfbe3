"""The job registry: plugins, config-declared jobs and their owners.

The only module that talks to pluggy's hooks. :meth:`Registry.load`, in
order: (1) blocks the plugins ``$PGJOBS_DISABLE_PLUGINS=a,b`` names; (2)
loads the installed plugins of the ``pgjobs`` entry-point group: all of
them, or only those the ``entry_points`` argument, else
``$PGJOBS_LOAD_PLUGINS=a,b``, else the config file's ``entry_points`` names
(a module the config's ``plugins`` lists may be named too: those always
load); (3) imports the config file's
``plugins`` modules, then any plugin objects passed in; (4) refuses hooks
with no spec (``check_pending()``); (5) runs each plugin's
``pgjobs_register_jobs(register)``; (6) adds the config file's jobs and
applies its overrides (a derived table, ``[derived.NAME]`` or a
:class:`~pgjobs.Derived` a plugin registers, is its two jobs, each
remembering it); (7) refuses jobs that write one table from different
groups, and a cycle among derived tables. A plugin that fails while
loading or registering is a :class:`~pgjobs.PluginError` naming it.

Each step's reasons: ``docs/DESIGN.md``, "Config and plugins".
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import pluggy

from . import hookspecs
from .config import Config, load_config
from .derived import Derived, chain_order
from .errors import ConfigError, PluginError
from .jobs import Job, QueueJob, RecomputeJob

log = logging.getLogger(__name__)

ENV_LOAD = "PGJOBS_LOAD_PLUGINS"
ENV_DISABLE = "PGJOBS_DISABLE_PLUGINS"
ENTRY_POINT_GROUP = hookspecs.PROJECT


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names_from_env(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


@dataclass(frozen=True, slots=True)
class Registered:
    """A job and who registered it."""

    job: Job
    #: the plugin's distribution (or module) name, or the config file
    owner: str
    #: the config file that declares the job (``None`` for a plugin's job)
    config: Path | None = None
    #: the derived table the job was made for (``[derived.NAME]``), if any
    derived: Derived | None = None

    @property
    def where(self) -> str:
        """How errors about this job start: the config key, or the plugin."""
        if self.derived is not None:
            return self.derived.where
        if self.config is not None:
            return f"{self.config}: jobs.{self.job.name}"
        return f"job {self.job.name!r} (plugin {self.owner!r})"

    def key(self, setting: str) -> str:
        """``where`` followed by one setting: ``pgjobs.toml: jobs.x.target``."""
        return f"{self.where}.{setting}" if self.config is not None else f"{self.where}: {setting}"


class Registry:
    """Jobs by name, each with its owner. Build one with :meth:`load`.

    >>> registry = Registry.load(pgjobs.load_config())
    >>> [(job.name, registry.owner(job.name)) for job in registry.jobs()]
    """

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._entries: dict[str, Registered] = {}
        self._owners: dict[str, str] = {}  # plugin name -> owner shown to users
        self._filtered = False  # some installed plugins were deliberately not loaded

    # -- building ------------------------------------------------------------
    @classmethod
    def load(
        cls,
        config: Config | None = None,
        *,
        plugins: Iterable[object] = (),
        entry_points: bool | Iterable[str] = True,
        env: Mapping[str, str] | None = None,
    ) -> Registry:
        """Load plugins and the config's jobs (the steps in the module docstring).

        ``plugins``: extra plugin objects (modules with ``@pgjobs.hookimpl``
        functions) for embedders. ``entry_points``: ``True`` loads the
        installed plugins ``$PGJOBS_LOAD_PLUGINS``, else the config's
        ``entry_points``, selects (all when neither is set); ``False`` or
        ``[]`` none; a list of entry-point or distribution names only those.
        """
        config = config or Config()
        environ = os.environ if env is None else env
        registry = cls()
        disabled = {_canonical(n) for n in _names_from_env(environ.get(ENV_DISABLE, ""))}
        registry._filtered = bool(disabled)
        if entry_points is not False:
            selection = _selection(config, entry_points, environ)
            registry._load_entry_points(disabled, selection, config.plugins)
        registry._load_modules(config, disabled)
        for plugin in plugins:
            registry._add_plugin(plugin, getattr(plugin, "__name__", None) or repr(plugin), None)
        try:
            registry._pm.check_pending()
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {registry._plugin_name(exc.plugin)!r}: {exc}") from exc
        registry._collect()
        registry._add_config(config)
        registry._check_groups()
        registry._check_derived()
        return registry

    @classmethod
    def from_jobs(cls, jobs: Iterable[Job | Derived], *, owner: str = "application") -> Registry:
        """A registry of ``jobs`` (and derived tables) given directly (no
        plugins), validated the same way."""
        registry = cls()
        for job in jobs:
            registry._register(job, owner, plugin=False)
        registry._check_groups()
        registry._check_derived()
        return registry

    def mapped(self, change: Callable[[Job], Job]) -> Registry:
        """A copy whose jobs are ``change(job)``, each keeping its owner (a
        host application wraps the jobs' bodies: ``pgjobs.contrib.django``
        closes Django's connections around them)."""
        changed = copy.copy(self)  # the plugins and owners shared, the jobs its own
        changed._entries = {n: replace(e, job=change(e.job)) for n, e in self._entries.items()}
        return changed

    def _load_entry_points(
        self,
        disabled: set[str],
        selection: tuple[str, tuple[str, ...]] | None,
        modules: tuple[str, ...],
    ) -> None:
        found = _installed()
        wanted = None if selection is None else {_canonical(n) for n in selection[1]}
        if selection is not None and wanted:
            where, given = selection
            known = {_canonical(ep.name) for _, ep in found} | {
                _canonical(d.name) for d, _ in found
            }
            # A module of the config's plugins is named there too ("only my
            # application's jobs"); it loads anyway, with the config.
            known |= {_canonical(m) for m in modules}
            missing = [n for n in given if _canonical(n) not in known]
            if missing:
                installed = sorted({ep.name for _, ep in found}) or ["none"]
                # The environment is the operator's (a plugin problem); the
                # file or an embedder's argument, a configuration mistake.
                error = PluginError if where == f"${ENV_LOAD}" else ConfigError
                raise error(
                    f"{where}: no installed plugin named {', '.join(map(repr, missing))} "
                    f"(installed: {', '.join(installed)}"
                    + (f"; modules in plugins: {', '.join(modules)}" if modules else "")
                    + ")"
                )
        for dist, ep in found:
            names = {_canonical(ep.name), _canonical(dist.name)}
            if names & disabled:
                self._pm.set_blocked(ep.name)
                continue
            if wanted is not None and not names & wanted:
                self._filtered = True
                continue
            if self._pm.has_plugin(ep.name):
                continue  # one distribution seen twice on sys.path
            try:
                self._pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
            except Exception as exc:
                raise PluginError(
                    f"plugin {ep.name!r} (from {dist.name}) cannot be loaded: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            self._owners[ep.name] = dist.name

    def _load_modules(self, config: Config, disabled: set[str]) -> None:
        if not config.plugins:
            return
        # Modules next to the config file import as they would from that directory.
        base = str((config.path.parent if config.path else Path.cwd()).resolve())
        added = base not in sys.path
        if added:
            sys.path.insert(0, base)
        try:
            for index, name in enumerate(config.plugins):
                if _canonical(name) in disabled:
                    self._pm.set_blocked(name)
                    continue
                where = f"{config.source}: plugins[{index}]"
                try:
                    module = importlib.import_module(name)
                except ModuleNotFoundError as exc:
                    if exc.name is not None and (
                        name == exc.name or name.startswith(exc.name + ".")
                    ):
                        raise PluginError(
                            f"{where}: no module named {name!r} (looked in {base} and sys.path)"
                        ) from exc
                    raise PluginError(f"{where}: module {name!r} failed to import: {exc}") from exc
                except Exception as exc:
                    raise PluginError(
                        f"{where}: module {name!r} failed to import: {type(exc).__name__}: {exc}"
                    ) from exc
                self._add_plugin(module, name, where)
        finally:
            if added:
                sys.path.remove(base)

    def _add_plugin(self, plugin: object, name: str, where: str | None) -> None:
        if self._pm.is_registered(plugin) or self._pm.is_blocked(name):
            return
        try:
            self._pm.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"{where or 'plugin'} {name!r}: {exc}") from exc
        except ValueError as exc:  # another plugin already took the name
            raise PluginError(f"{where or 'plugin'} {name!r}: {exc}") from exc
        self._owners.setdefault(name, name)

    def _plugin_name(self, plugin: object) -> str:
        name = self._pm.get_name(plugin)
        return self._owners.get(name, name) if name else repr(plugin)

    def _collect(self) -> None:
        plugins = [(name, p) for name, p in self._pm.list_name_plugin() if p is not None]
        for name, plugin in plugins:
            owner = self._owners.get(name, name)
            # One plugin at a time, so that every job is credited to its owner.
            caller = self._pm.subset_hook_caller(
                "pgjobs_register_jobs", remove_plugins=[p for _, p in plugins if p is not plugin]
            )

            def register(job: Job, _owner: str = owner) -> None:
                self._register(job, _owner)

            try:
                caller(register=register)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(
                    f"plugin {owner!r}: pgjobs_register_jobs failed: {type(exc).__name__}: {exc}"
                ) from exc

    def _register(
        self,
        job: object,
        owner: str,
        config: Path | None = None,
        *,
        plugin: bool = True,
        derived: Derived | None = None,
    ) -> None:
        # A plugin's mistake is a PluginError; the config's or an embedder's a ConfigError.
        error = PluginError if plugin and config is None else ConfigError
        if isinstance(job, Derived):
            # a derived table is its two jobs, each remembering the declaration
            for made in job.jobs():
                self._register(made, owner, config, plugin=plugin, derived=job)
            return
        if not isinstance(job, Job):
            raise error(
                f"{'plugin ' if plugin else ''}{owner!r} registered {job!r}: expected a "
                "pgjobs.RecomputeJob, QueueJob, TaskJob or Derived"
            )
        entry = Registered(job, owner, config, derived)
        first = self._entries.get(job.name)
        if first is not None:
            message = (
                f"job {job.name!r} is registered twice: by {first.owner!r} and by {owner!r}; "
                "job names must be unique"
            )
            raise error(f"{entry.where}: {message}" if config is not None else message)
        self._entries[job.name] = entry

    def _add_config(self, config: Config) -> None:
        owner = config.source
        for job in config.jobs:
            self._register(job, owner, config.path)
        for declared in config.derived:
            self._register(declared, owner, config.path)
        for name, override in config.overrides.items():
            entry = self._entries.get(name)
            where = f"{config.source}: jobs.{name}"
            if entry is None:
                known = ", ".join(sorted(self._entries)) or "none"
                if self._filtered:
                    # Its plugin may be the one switched off on purpose.
                    log.warning(
                        "pgjobs: %s overrides no registered job (plugins are filtered); ignored",
                        where,
                    )
                    continue
                raise ConfigError(
                    f"{where}: no registered job is named {name!r} (registered: {known}); "
                    "to declare a job here, give it a kind (recompute, queue or task)"
                )
            try:
                job = override.apply(entry.job)
            except ConfigError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            self._entries[name] = replace(entry, job=job)

    def _check_groups(self) -> None:
        writers: dict[str, list[Registered]] = {}
        for entry in self._entries.values():
            target = getattr(entry.job, "target", None)
            if target:
                writers.setdefault(target.split(".")[-1], []).append(entry)
        for entries in writers.values():
            for i, a in enumerate(entries):
                for b in entries[i + 1 :]:
                    if _same_table(a.job, b.job) and a.job.group != b.job.group:
                        target = getattr(a.job, "target", "")
                        raise ConfigError(
                            f"{a.where} (group {a.job.group!r}) and "
                            f"{b.where} (group {b.job.group!r}) "
                            f"both write table {target!r}: jobs that write one table must share a "
                            "group, so that one advisory lock keeps them from running at once; "
                            "give them the same group"
                        )
        self._link_flow(writers)

    def _link_flow(self, writers: dict[str, list[Registered]]) -> None:
        """Give each recompute with flow on the scope of its group's queue
        workers on its target (:attr:`RecomputeJob.worker_scope`), when they
        all have flow on and one scope. That is what this process knows;
        each run also reads the records the workers leave wherever they run
        (:mod:`pgjobs.flow`), and has flow only when both agree."""
        for entries in writers.values():
            for entry in entries:
                job = entry.job
                if not isinstance(job, RecomputeJob) or not job.flow:
                    continue
                workers = [
                    e.job
                    for e in entries
                    if isinstance(e.job, QueueJob) and _same_table(job, e.job)
                ]
                scopes = {w.scope for w in workers}
                scope = scopes.pop() if len(scopes) == 1 and all(w.flow for w in workers) else None
                if scope != job.worker_scope:
                    self._entries[job.name] = replace(entry, job=job.replace(worker_scope=scope))

    def _check_derived(self) -> None:
        """Refuse a cycle among the derived tables (:func:`chain_order`)."""
        chain_order(self.derived())

    # -- reading -------------------------------------------------------------
    def derived(self) -> list[Derived]:
        """The derived tables declared (``[derived.NAME]``, ``register(Derived(...))``),
        in dependency order: a table after those it reads."""
        found: dict[str, Derived] = {}
        for entry in self._entries.values():
            if entry.derived is not None:
                found.setdefault(entry.derived.name, entry.derived)
        return chain_order(found.values())

    def get(self, name: str) -> Job:
        """The job named ``name``; :class:`ConfigError` naming it and the known jobs."""
        entry = self._entries.get(name)
        if entry is None:
            known = ", ".join(sorted(self._entries)) or "none"
            raise ConfigError(f"no job named {name!r} (registered: {known})")
        return entry.job

    def owner(self, name: str) -> str:
        """Who registered the job: a plugin's distribution or module name, or the config file."""
        self.get(name)
        return self._entries[name].owner

    def entry(self, name: str) -> Registered:
        """The job ``name`` with its owner."""
        self.get(name)
        return self._entries[name]

    def entries(self) -> list[Registered]:
        """Every registration, by job name."""
        return [self._entries[name] for name in sorted(self._entries)]

    def jobs(self, *, enabled_only: bool = False) -> list[Job]:
        """Every job, by name; ``enabled_only`` leaves out ``enabled = false``."""
        return [e.job for e in self.entries() if e.job.enabled or not enabled_only]

    def plugins(self) -> list[str]:
        """The loaded plugins, as owners are shown."""
        return [
            self._owners.get(name, name) for name, p in self._pm.list_name_plugin() if p is not None
        ]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Job]:
        return iter(self.jobs())

    def __len__(self) -> int:
        return len(self._entries)


def _installed() -> list[tuple[importlib.metadata.Distribution, importlib.metadata.EntryPoint]]:
    """The installed plugins: each distribution with its ``pgjobs`` entry point."""
    return [
        (dist, ep)
        for dist in importlib.metadata.distributions()
        for ep in dist.entry_points
        if ep.group == ENTRY_POINT_GROUP
    ]


def _selection(
    config: Config, entry_points: Iterable[str] | bool, environ: Mapping[str, str]
) -> tuple[str, tuple[str, ...]] | None:
    """Which installed plugins to load, and who said so: ``None`` for all.
    The caller's argument wins, then the operator's environment, then the file."""
    if isinstance(entry_points, bool):  # False never gets here: no installed plugin
        only = environ.get(ENV_LOAD)
        if only is not None:
            return f"${ENV_LOAD}", tuple(_names_from_env(only))
        if config.entry_points is not None:
            return f"{config.source}: entry_points", config.entry_points
        return None
    names = () if isinstance(entry_points, str) else tuple(entry_points)
    if isinstance(entry_points, str) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(
            "entry_points: expected a list of installed plugins' entry-point or distribution "
            f"names, got {entry_points!r}"
        )
    return "entry_points", names


def _same_table(a: Job, b: Job) -> bool:
    """Conservatively: ``x`` and ``s.x`` may be one table (search_path)."""
    ta, tb = getattr(a, "target", ""), getattr(b, "target", "")
    if ta == tb:
        return True
    pa, pb = ta.split("."), tb.split(".")
    return pa[-1] == pb[-1] and (len(pa) == 1 or len(pb) == 1)


_default: Registry | None = None
_default_lock = threading.Lock()


def get_registry() -> Registry:
    """The process-wide registry (:func:`pgjobs.run_once` looks names up in it):
    installed plugins and the config file :func:`~pgjobs.load_config` finds,
    loaded on first use. Replace it with :func:`set_registry`."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Registry.load(load_config())
        return _default


def set_registry(registry: Registry | None) -> None:
    """Make ``registry`` the process-wide one (``None``: load again on next use)."""
    global _default
    with _default_lock:
        _default = registry


__all__ = ["ENV_DISABLE", "ENV_LOAD", "Registered", "Registry", "get_registry", "set_registry"]
