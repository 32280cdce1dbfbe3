"""The house rules of pgjobs' imports (scripts/check_imports.py), on the
real tree and on drawn graphs that break them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_imports.py"


def load_checker():
    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_imports"] = module
    spec.loader.exec_module(module)
    return module


def test_the_tree_has_no_cycle_and_every_import_runs_one_way() -> None:
    checker = load_checker()
    edges = checker.graph()
    assert "runner" in edges and "jobs" in edges  # it read the package
    assert checker.problems(edges) == []


def test_the_model_imports_nothing_above_it() -> None:
    checker = load_checker()
    edges = checker.graph()
    model = next(members for name, members in checker.LAYERS if name == "model")
    base = next(members for name, members in checker.LAYERS if name == "base")
    for module in model:
        above = {m for m in edges[module] if m.split(".")[0] not in model | base}
        assert above == set(), f"{module} imports {above}"


def test_a_cycle_is_found_and_named() -> None:
    checker = load_checker()
    edges = {"jobs": {"results"}, "results": {"errors"}, "errors": {"jobs"}, "backoff": set()}
    assert checker.cycles(edges) == [["errors", "jobs", "results"]]
    assert "import cycle: errors <-> jobs <-> results" in checker.problems(edges)


def test_an_import_from_a_layer_above_is_refused() -> None:
    checker = load_checker()
    edges = {"jobs": {"runner"}, "runner": set()}
    assert checker.problems(edges) == ["jobs (model) imports runner (protocol), a layer above it"]


def test_imports_inside_functions_and_under_type_checking_count(tmp_path: Path) -> None:
    checker = load_checker()
    source = tmp_path / "jobs.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .runner import Runner\n"
        "def f():\n    from .diff import write_diff\n    import pgjobs.queue\n"
    )
    known = {"jobs", "runner", "diff", "queue"}
    assert checker.imports_of(source, "jobs", known) == {"runner", "diff", "queue"}


def test_every_module_says_what_it_offers() -> None:
    assert load_checker().without_all() == []


def test_the_house_table_is_checked_against_the_layers() -> None:
    checker = load_checker()
    text = checker.DESIGN.read_text(encoding="utf-8")
    assert checker.table_problems(text) == []
    # a module dropped from its row, and one named on the wrong floor
    broken = text.replace("`steps`, ", "", 1).replace("`readmodel`", "`readmodel`, `runner`", 1)
    found = checker.table_problems(broken)
    assert "DESIGN.md: layer 'protocol' does not name 'steps' (LAYERS does)" in found
    assert "DESIGN.md: layer 'writers' names 'runner', which LAYERS does not" in found
