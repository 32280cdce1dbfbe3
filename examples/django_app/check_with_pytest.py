"""The helpers on pytest-django (``python -m pytest`` in this folder):
``django_db(transaction=True)``, as pgjobs sees committed rows only."""

import pytest
from blog.models import Author, AuthorStats
from blog.services import publish

from pgjobs.contrib.django.testing import assert_no_drift, reset, run_pending

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _empty_pgjobs_tables() -> None:
    reset()


def test_run_pending_then_no_drift() -> None:
    ann = Author.objects.create(name="ann")
    publish(ann.pk, "hello", 120)
    run_pending()
    assert AuthorStats.objects.get(pk=ann.pk).words == 120
    assert_no_drift("author-stats")


def test_drift_is_reported() -> None:
    ann = Author.objects.create(name="ann")
    publish(ann.pk, "hello", 120)
    with pytest.raises(AssertionError, match=r"drift in public.author_stats: \+1 ~0 -0"):
        assert_no_drift("author-stats")
