"""Settings of the example: a blog whose per-author figures pgjobs keeps.

The database: ``$BLOG_DATABASE_URL`` (default
``postgresql://postgres@127.0.0.1:5432/blog``); ``$BLOG_TRANSACTION_POOLING=1``
when that is a PgBouncer in transaction mode.
"""

import os
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-only-not-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "pgjobs.contrib.django",
    "blog",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]

ROOT_URLCONF = "blogsite.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

_url = urlsplit(os.environ.get("BLOG_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/blog"))
# libpq's host and port may come as query parameters (a socket directory:
# postgresql://postgres@/blog?host=/var/run/postgresql)
_query = dict(parse_qsl(_url.query))
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _url.path.lstrip("/"),
        "USER": unquote(_url.username or ""),
        "PASSWORD": unquote(_url.password or ""),
        "HOST": _query.get("host") or _url.hostname or "",
        "PORT": _query.get("port") or _url.port or "",
        # behind PgBouncer in transaction mode (Django's own setting for it;
        # pgjobs then prepares no statement either)
        "DISABLE_SERVER_SIDE_CURSORS": os.environ.get("BLOG_TRANSACTION_POOLING") == "1",
    }
}

# pgjobs.toml's keys, as a dict: the jobs that keep author_stats.
PGJOBS = {
    "namespace": "blog",
    "entry_points": [],  # no installed plugin's jobs: only those below
    "shutdown_timeout": "10s",
    "jobs": {
        # Every 10 minutes, all authors from scratch; only the difference is written.
        "author-stats": {
            "kind": "recompute",
            "target": "author_stats",
            "sql_file": "blog/author_stats.sql",
            "every": "10m",
            "backoff": "1h",
        },
        # Every second (and at once, woken by enqueue's notification), the
        # authors that blog.services.publish() enqueued.
        "author-stats-worker": {
            "kind": "queue",
            "target": "author_stats",
            "scope": "author_id",
            "every": "1s",
            "batch_size": 100,
            "sql": """
                select a.id as author_id, count(p.id)::integer as posts,
                       coalesce(sum(p.words), 0)::integer as words,
                       max(p.created_at) as last_post_at
                from author a left join post p on p.author_id = a.id
                where a.id = any(:keys)
                group by a.id
            """,
        },
    },
    # Declared once: the recompute `post-counts`, the queue job
    # `post-counts:queue`, and triggers on `author` and `post` that enqueue
    # the authors every statement touches, in its own transaction. No
    # enqueue in the application's code; `manage.py pgjobs run` (or
    # `manage.py pgjobs migrate`) installs the triggers.
    "derived": {
        "post-counts": {
            "target": "post_counts",
            "scope": ["author_id"],
            "sql": """
                select a.id as author_id, count(p.id)::integer as posts,
                       coalesce(sum(p.words), 0)::integer as words
                from author a left join post p on p.author_id = a.id
                group by a.id
            """,
            "every": "10m",
            "sources": {"author": ["id"], "post": ["author_id"]},
        },
    },
}

STATIC_URL = "static/"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
