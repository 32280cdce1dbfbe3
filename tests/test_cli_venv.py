"""A plugin package, installed into a fresh virtual environment, is found by
``pgjobs list`` with no code change; ``PGJOBS_DISABLE_PLUGINS`` blocks it.

To stay fast and work offline, the fresh environment borrows pgjobs'
*third-party* dependencies (SQLAlchemy, psycopg, pluggy, APScheduler, click
and what they need) from the running one: symbolic links to just those
distributions, in a directory a ``.pth`` line puts on ``sys.path``. Nothing
else of the running environment is visible there: not its pgjobs, not any
plugin installed in it (the test checks both first). pgjobs itself and the
plugin are then really built and installed into the new environment by pip,
from copies of their sources, with ``--no-deps``. When the running
environment's setuptools can build wheels (70.1 or later, or an older one
with ``wheel``), it is borrowed too and pip builds with it
(``--no-build-isolation``: offline, a few seconds); otherwise pip fetches
setuptools into an isolated build environment from its index, as any
``pip install`` of a source tree does (slower, and needs the index).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from sqlalchemy import text
from sqlalchemy.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "plugins" / "pgjobs-example"


def run(args: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def can_build_here() -> bool:
    """Can the borrowed setuptools build wheels by itself (bdist_wheel is built
    into setuptools from 70.1; older ones need the ``wheel`` package)?"""
    try:
        version = tuple(int(p) for p in metadata.version("setuptools").split(".")[:2])
    except metadata.PackageNotFoundError:
        return False
    if version >= (70, 1):
        return True
    try:
        metadata.version("wheel")
    except metadata.PackageNotFoundError:
        return False
    return version >= (64, 0)


def requirements_of(name: str) -> dict[str, metadata.Distribution]:
    """``name``'s installed dependencies, recursively, with the extras they ask for."""
    found: dict[str, metadata.Distribution] = {}
    extras: dict[str, set[str]] = {}
    todo: list[tuple[str, set[str]]] = [(name, set())]
    while todo:
        wanted, wanted_extras = todo.pop()
        dist = metadata.distribution(wanted)
        key = canonicalize_name(dist.metadata["Name"])
        if key in found and wanted_extras <= extras[key]:
            continue
        found[key] = dist
        extras[key] = extras.get(key, set()) | wanted_extras
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(
                req.marker.evaluate({"extra": e}) for e in {"", *extras[key]}
            ):
                todo.append((req.name, set(req.extras)))
    return found


def borrow(dists: list[metadata.Distribution], into: Path) -> None:
    """Link the top-level files of ``dists`` (packages, modules, dist-info) into ``into``."""
    into.mkdir()
    for dist in dists:
        root = Path(str(dist.locate_file(""))).resolve()
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            if not (into / top).exists() and (root / top).exists():
                (into / top).symlink_to(root / top)


def _installed(name: str) -> bool:
    try:
        metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def copy_source(src: Path, dest: Path, names: list[str]) -> Path:
    dest.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", ".pytest_cache")
    for name in names:
        path = src / name
        if path.is_dir():
            shutil.copytree(path, dest / name, ignore=ignore)
        elif path.exists():
            shutil.copy2(path, dest / name)
    return dest


def test_an_installed_plugin_is_listed_and_can_be_disabled(
    tmp_path: Path, engine: Engine, db_url: str
) -> None:
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    site = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            cwd=tmp_path,
            env={},
        ).stdout.strip()
    )
    dependencies = requirements_of("pgjobs-derived")
    dependencies.pop("pgjobs-derived")
    borrowed = list(dependencies.values())
    if can_build_here():
        borrowed += [metadata.distribution(n) for n in ("setuptools", "wheel") if _installed(n)]
    borrow(borrowed, tmp_path / "borrowed")
    (site / "_borrowed.pth").write_text(f"{tmp_path / 'borrowed'}\n")

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PGJOBS_", "PYTHON", "VIRTUAL_ENV"))
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PGJOBS_DATABASE_URL"] = db_url
    # Nothing of pgjobs yet: only the dependencies are visible.
    probe = run(
        [str(python), "-c", "import pluggy, sqlalchemy; import pgjobs"], cwd=tmp_path, env=env
    )
    assert probe.returncode != 0 and "No module named 'pgjobs'" in probe.stderr, probe.stderr
    count = "from importlib.metadata import entry_points; print(len(entry_points(group='pgjobs')))"
    assert run([str(python), "-c", count], cwd=tmp_path, env=env).stdout.strip() == "0"

    main = copy_source(ROOT, tmp_path / "pgjobs-src", ["pyproject.toml", "README.md", "pgjobs"])
    plugin = copy_source(
        PLUGIN, tmp_path / "plugin", ["pyproject.toml", "README.md", "pgjobs_example"]
    )
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q"]
    if can_build_here():
        pip.append("--no-build-isolation")  # offline, with the borrowed setuptools
    installed = run(
        [*pip, str(main), str(plugin)],
        cwd=tmp_path,
        env={**env, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    pgjobs = str(venv / "bin" / "pgjobs")
    # Installed under its distribution name (``pgjobs`` on the index is another
    # project), imported as pgjobs.
    version = run([pgjobs, "--version"], cwd=tmp_path, env=env)
    assert version.returncode == 0, version.stderr
    assert "distribution pgjobs-derived" in version.stdout, version.stdout
    names = "from importlib.metadata import distribution as d; print(d('pgjobs-derived').name)"
    assert run([str(python), "-c", names], cwd=tmp_path, env=env).stdout.strip() == (
        "pgjobs-derived"
    )
    listed = run([pgjobs, "list"], cwd=tmp_path, env=env)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()]
    assert [
        "example-expire-sessions",
        "pgjobs-example",
        "task",
        "example-session",
        "every",
        "5m",
        "yes",
    ] in rows

    for name in ("example", "pgjobs-example"):
        blocked = run([pgjobs, "list"], cwd=tmp_path, env={**env, "PGJOBS_DISABLE_PLUGINS": name})
        assert blocked.returncode == 0, blocked.stderr
        assert "example-expire-sessions" not in blocked.stdout

    # And it runs from there: the installed job deletes the expired sessions.
    with engine.begin() as conn:
        conn.execute(
            text(
                "create table example_session (id bigint generated always as identity primary key,"
                " user_name text not null, expires_at timestamptz not null)"
            )
        )
        conn.execute(
            text(
                "insert into example_session (user_name, expires_at) values"
                " ('a', now() - interval '1 day'), ('b', now() - interval '1 hour'),"
                " ('c', now() + interval '1 hour')"
            )
        )
    once = run([pgjobs, "once", "example-expire-sessions"], cwd=tmp_path, env=env)
    assert once.returncode == 0, once.stdout + once.stderr
    assert "example-expire-sessions: ran" in once.stdout and "deleted 2," in once.stdout
    with engine.connect() as conn:
        assert conn.execute(text("select array_agg(user_name) from example_session")).scalar() == [
            "c"
        ]
