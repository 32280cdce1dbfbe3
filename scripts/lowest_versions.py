#!/usr/bin/env python3
"""The lowest versions pyproject.toml declares: a pip constraints file that
pins every direct dependency, and every requirement of each extra, to its
declared lower bound (``name==bound``), read from ``[project]`` so that no
list is kept by hand. .ci/lowest installs pgjobs with it and runs the tests.

    scripts/lowest_versions.py                 the constraints, one a line
    scripts/lowest_versions.py --extras        the extras they cover, one a line
    scripts/lowest_versions.py --leave-out docs --leave-out django ...

Every extra is covered but the project's own tools (:data:`TOOLS`: what
runs its tests and checks, no promise to users) and those left out (one
whose lowest versions cannot install on this Python, say). A requirement
without a lower bound (``foo``, ``foo<2``, ``foo>1``) is an error (exit 2):
there is no lowest version to test. Where a name is declared more than once
(``sqlalchemy`` and ``sqlalchemy[asyncio]``), the highest of its bounds is
the one that installs with all of them. A requirement whose environment
marker does not hold here is not pinned (said on stderr).

Needs ``packaging`` (pytest's dependency: the CI's virtualenv has it).
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

#: extras that hold the project's own tools, not features it promises users
TOOLS = ("test", "dev")
#: specifier operators that set a lowest version (``~=2.1``: 2.1 and up)
LOWER = (">=", "==", "~=", "===")

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


class Undeclared(Exception):
    """A requirement of pyproject.toml that has no lowest version to pin."""


def lowest(requirement: Requirement, where: str) -> Version:
    """The lowest version ``requirement`` allows (its highest lower bound)."""
    bounds = []
    for spec in requirement.specifier:
        if spec.operator not in LOWER:
            continue
        if spec.version.endswith(".*"):
            raise Undeclared(f"{where}: {requirement}: == with a wildcard is no lowest version")
        bounds.append(Version(spec.version))
    if not bounds:
        raise Undeclared(
            f"{where}: {requirement}: no lower bound (>=, ==, ~=): no lowest version to test"
        )
    return max(bounds)


def constraints(
    pyproject: Path, leave_out: set[str]
) -> tuple[dict[str, Version], list[str], list[str]]:
    """The pins (canonical name: version), the extras covered, and notes
    on what was not pinned."""
    project = tomllib.loads(pyproject.read_text()).get("project", {})
    own = canonicalize_name(project.get("name", ""))
    extras: dict[str, list[str]] = project.get("optional-dependencies", {})
    unknown = leave_out - set(extras)
    if unknown:
        raise Undeclared(
            f"{pyproject}: [project.optional-dependencies] has no extra {sorted(unknown)}"
            f" (it has {sorted(extras)})"
        )
    groups = [("[project] dependencies", project.get("dependencies", []))]
    covered = [name for name in extras if name not in TOOLS and name not in leave_out]
    groups += [(f"[project.optional-dependencies] {name}", extras[name]) for name in covered]
    environment = default_environment()
    pins: dict[str, Version] = {}
    notes: list[str] = []
    for key, requirements in groups:
        where = f"{pyproject}: {key}"
        for text in requirements:
            try:
                requirement = Requirement(text)
            except InvalidRequirement as exc:
                raise Undeclared(f"{where}: {text!r}: {exc}") from None
            name = canonicalize_name(requirement.name)
            if name == own:
                continue  # another extra of pgjobs' own: covered where it is declared
            if requirement.marker is not None and not requirement.marker.evaluate(
                {**environment, "extra": ""}
            ):
                notes.append(f"{where}: {text!r}: not for this environment, not pinned")
                continue
            version = lowest(requirement, where)
            if name in pins and pins[name] != version:
                notes.append(
                    f"{where}: {text!r}: {name} has bounds {pins[name]} and {version};"
                    f" the higher one is pinned"
                )
            pins[name] = max(version, pins.get(name, version))
    return pins, covered, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Pin pyproject.toml's direct dependencies and extras to their lower bounds."
    )
    parser.add_argument(
        "--leave-out",
        action="append",
        default=[],
        metavar="EXTRA",
        help="an extra not to cover (repeatable)",
    )
    parser.add_argument(
        "--extras", action="store_true", help="print the extras covered instead, one a line"
    )
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        pins, covered, notes = constraints(args.pyproject, set(args.leave_out))
    except (Undeclared, OSError, tomllib.TOMLDecodeError) as exc:
        print(f"lowest_versions.py: {exc}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"lowest_versions.py: {note}", file=sys.stderr)
    if args.extras:
        print("\n".join(covered))
    else:
        print("\n".join(f"{name}=={version}" for name, version in sorted(pins.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
