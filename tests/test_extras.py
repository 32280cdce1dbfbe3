"""Tests that need a program beyond Python and PostgreSQL: skipped with the
install hint where it is missing, failed where CI requires them, and named
in the run's summary."""

from __future__ import annotations

import os
import shutil
import textwrap
from pathlib import Path

import pytest
from extras import ENV_REQUIRE, binary, first_address, retarget
from sqlalchemy.engine import make_url

pytest_plugins = ["pytester"]

HERE = Path(__file__).parent


def test_a_missing_program_skips_the_test_with_its_install_hint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV_REQUIRE, raising=False)
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    with pytest.raises(pytest.skip.Exception, match=r"apt-get install -y pgbouncer"):
        binary("pgbouncer")


def test_where_extras_are_required_a_missing_program_fails_the_test(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_REQUIRE, "1")
    monkeypatch.setattr(shutil, "which", lambda *args, **kwargs: None)
    with pytest.raises(pytest.fail.Exception, match=r"needs chromium.*apt-get install -y chromium"):
        binary("chromium")


def test_the_summary_names_what_was_left_out_and_how_to_install_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_REQUIRE, raising=False)
    monkeypatch.setenv("PATH", str(pytester.path))  # none of the programs is on it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    pytester.makeconftest(
        (HERE / "conftest.py").read_text()
        + textwrap.dedent(
            """
            import shutil
            shutil.which = lambda *args, **kwargs: None
            """
        )
    )
    pytester.makeini("[pytest]\nmarkers =\n    needs(program): needs a program\n    slow: a soak\n")
    pytester.makepyfile(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.needs("pgbouncer")
            def test_through_a_pooler():
                raise AssertionError("not reached")

            @pytest.mark.needs("chromium")
            def test_in_a_browser():
                raise AssertionError("not reached")

            def test_plain():
                assert True
            """
        )
    )
    # in a process of its own: the inner conftest's shutil.which stays there
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(
        [
            "*left out for want of a program*",
            "1 test(s) need pgbouncer, not installed here: apt-get install -y pgbouncer*",
            "1 test(s) need chromium, not installed here: apt-get install -y chromium",
        ]
    )
    monkeypatch.setenv(ENV_REQUIRE, "1")
    required = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    required.assert_outcomes(passed=1, errors=2)  # failed at setup


@pytest.mark.parametrize(
    ("url", "first"),
    [
        ("postgresql+psycopg://postgres:@/postgres?host=/tmp/pg/data", ("/tmp/pg/data", 5432)),
        ("postgresql+psycopg://postgres@127.0.0.1:5432/test", ("127.0.0.1", 5432)),
        (
            "postgresql+psycopg://postgres@/app?host=127.0.0.1:6001&host=127.0.0.1:6002",
            ("127.0.0.1", 6001),
        ),
        ("postgresql+psycopg://postgres@/app?host=db&port=6543", ("db", 6543)),
    ],
)
def test_a_test_servers_url_pointed_elsewhere_drops_every_host_it_named(
    url: str, first: tuple[str, int]
) -> None:
    assert first_address(url) == first
    moved = make_url(retarget(url, host="127.0.0.1", port=7000))
    assert (moved.host, moved.port, moved.database) == ("127.0.0.1", 7000, make_url(url).database)
    assert not {"host", "port", "hostaddr"} & set(moved.query)
