"""The example's tests, on Django's test runner (``manage.py test blog``):
the admin's pages and actions, and pgjobs' test helpers. TransactionTestCase:
pgjobs works on connections of its own, which see committed rows only."""

import json
import threading

from asgiref.sync import async_to_sync
from django.contrib.auth.models import Permission, User
from django.db import connection, connections, transaction
from django.test import TransactionTestCase

from pgjobs import TaskJob
from pgjobs.contrib.django.host import closing_connections
from pgjobs.contrib.django.models import JobState, QueueItem
from pgjobs.contrib.django.testing import PgJobsTestMixin

from .models import Author, AuthorStats, Post
from .services import apublish, publish


class HelpersTest(PgJobsTestMixin, TransactionTestCase):
    def test_run_pending_jobs_brings_the_stats_up_to_date(self) -> None:
        ann = Author.objects.create(name="ann")
        publish(ann.pk, "hello", 120)
        publish(ann.pk, "again", 30)
        self.assertFalse(AuthorStats.objects.exists())
        results = self.run_pending_jobs("author-stats-worker")
        self.assertEqual(results[0].stats.inserted, 1)
        stats = AuthorStats.objects.get(pk=ann.pk)
        self.assertEqual((stats.posts, stats.words), (2, 150))
        self.assertNoDrift("author-stats")

    def test_assert_no_drift_names_the_rows_a_recompute_would_write(self) -> None:
        ann = Author.objects.create(name="ann")
        Post.objects.create(author=ann, title="not enqueued", words=10)
        with self.assertRaisesMessage(AssertionError, "drift in public.author_stats: +1 ~0 -0"):
            self.assertNoDrift("author-stats")

    def test_a_rolled_back_enqueue_leaves_nothing_queued(self) -> None:
        ann = Author.objects.create(name="ann")
        with self.assertRaises(RuntimeError), transaction.atomic():
            publish(ann.pk, "draft", 5)
            raise RuntimeError("the request failed")
        self.assertFalse(Post.objects.exists())
        self.assertFalse(QueueItem.objects.exists())

    def test_an_async_view_enqueues_with_aenqueue(self) -> None:
        ann = Author.objects.create(name="ann")
        async_to_sync(apublish)(ann.pk, "from an async view", 40)
        self.assertEqual(
            list(QueueItem.objects.values_list("job", "key")), [("author-stats-worker", [ann.pk])]
        )
        self.run_pending_jobs()
        self.assertEqual(AuthorStats.objects.get(pk=ann.pk).words, 40)

    def test_a_job_body_using_the_orm_leaves_no_django_connection_open(self) -> None:
        Author.objects.create(name="ann")
        seen = {}

        def body(conn):
            seen["authors"] = Author.objects.count()  # opens this thread's connection
            seen["open inside"] = connections["default"].connection is not None

        job = closing_connections(TaskJob(name="orm-task", run=body, every="1h"))

        def worker_thread() -> None:  # as the scheduler's threads run bodies
            job.run(None)
            seen["open after"] = connections["default"].connection is not None

        thread = threading.Thread(target=worker_thread)
        thread.start()
        thread.join()
        self.assertEqual(seen, {"authors": 1, "open inside": True, "open after": False})

    def test_the_helpers_refuse_inside_a_transaction(self) -> None:
        with transaction.atomic(), self.assertRaisesMessage(RuntimeError, "TransactionTestCase"):
            self.run_pending_jobs()


class AdminTest(PgJobsTestMixin, TransactionTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.staff = User.objects.create_user("staff", password="x", is_staff=True)
        self.staff.user_permissions.add(
            *Permission.objects.filter(content_type__app_label="pgjobs")
        )
        self.viewer = User.objects.create_user("viewer", password="x", is_staff=True)
        self.viewer.user_permissions.add(
            *Permission.objects.filter(
                content_type__app_label="pgjobs", codename__startswith="view_"
            )
        )
        self.ann = Author.objects.create(name="ann")

    pages = (
        "/admin/pgjobs/",
        "/admin/pgjobs/jobstate/",
        "/admin/pgjobs/queueitem/",
        "/admin/pgjobs/run/",
    )

    def act(self, action: str, job: str, *keys: str) -> str:
        """Post one action; the page it leads back to (with its message)."""
        response = self.client.post(
            "/admin/pgjobs/jobstate/act/",
            {"action": action, "job": job, "key": list(keys)},
            follow=True,
        )
        self.assertEqual(response.redirect_chain[0][1], 302)
        self.assertEqual(response.status_code, 200)
        return response.content.decode()

    def test_staff_see_every_page_others_do_not(self) -> None:
        publish(self.ann.pk, "hello", 120)
        self.client.force_login(self.staff)
        for page in self.pages:
            with self.subTest(page=page):
                response = self.client.get(page)
                self.assertEqual(response.status_code, 200)
        jobs = self.client.get("/admin/pgjobs/jobstate/").content.decode()
        self.assertIn('href="/admin/pgjobs/run/?job=author-stats-worker"', jobs)  # its runs
        self.assertIn("Run once", jobs)
        for job in ("author-stats", "post-counts", "post-counts:queue"):  # declared: both jobs
            self.assertIn(f'title="its runs">{job}</a>', jobs)

        self.client.logout()
        # anonymous users: sent to the login page, their actions not taken
        for page in (*self.pages, "/admin/pgjobs/jobstate/act/"):
            with self.subTest(page=page):
                response = self.client.get(page)
                self.assertEqual(response.status_code, 302)
                self.assertIn("/admin/login/", response["Location"])
        self.client.post("/admin/pgjobs/jobstate/act/", {"action": "pause", "job": "author-stats"})
        self.assertFalse(JobState.objects.filter(paused_at__isnull=False).exists())
        # staff allowed to view, not to operate: see the pages, no action
        self.client.force_login(self.viewer)
        page = self.client.get("/admin/pgjobs/jobstate/")
        self.assertEqual(page.status_code, 200)
        self.assertNotIn("Run once", page.content.decode())
        response = self.client.post(
            "/admin/pgjobs/jobstate/act/", {"action": "pause", "job": "author-stats"}
        )
        self.assertEqual(response.status_code, 403)
        self.assertFalse(JobState.objects.filter(paused_at__isnull=False).exists())
        plain = User.objects.create_user("plain", password="x", is_staff=True)
        self.client.force_login(plain)
        self.assertEqual(self.client.get("/admin/pgjobs/jobstate/").status_code, 403)

    def test_pause_resume_run_once_and_revive(self) -> None:
        publish(self.ann.pk, "hello", 120)
        self.client.force_login(self.staff)
        self.act("pause", "author-stats-worker")
        state = JobState.objects.get(pk="author-stats-worker")
        self.assertIsNotNone(state.paused_at)
        self.assertIn("paused since", self.client.get("/admin/pgjobs/jobstate/").content.decode())
        self.act("resume", "author-stats-worker")
        self.assertIsNone(JobState.objects.get(pk="author-stats-worker").paused_at)
        ran = self.act("once", "author-stats-worker")
        self.assertIn("author-stats-worker: ran in", ran)
        self.assertEqual(AuthorStats.objects.get(pk=self.ann.pk).words, 120)
        checked = self.act("check", "author-stats")
        self.assertIn("author-stats: no drift: a recompute would insert 0, update 0", checked)
        self.assertFalse(QueueItem.objects.exists())
        runs = self.client.get("/admin/pgjobs/run/").content.decode()
        self.assertIn('<td class="field-outcome">ran</td>', runs)
        # a dead item, revived
        publish(self.ann.pk, "again", 30)
        with connection.cursor() as cursor:  # as a worker parks an item
            cursor.execute("update pgjobs.queue set dead_at = now(), attempts = 5")
        page = self.client.get("/admin/pgjobs/queueitem/").content.decode()
        self.assertIn(json.dumps([self.ann.pk]), page)
        self.act("revive", "author-stats-worker", json.dumps([self.ann.pk]))
        item = QueueItem.objects.get()
        self.assertEqual((item.dead_at, item.attempts), (None, 0))
