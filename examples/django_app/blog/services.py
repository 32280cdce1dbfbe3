"""Writes that change what author_stats derives from enqueue the author in
the same transaction: committed, the worker recomputes that author's row;
rolled back, nothing is queued."""

from django.db import transaction

from pgjobs.contrib.django import aenqueue, enqueue

from .models import Post


def publish(author_id: int, title: str, words: int) -> Post:
    with transaction.atomic():
        post = Post.objects.create(author_id=author_id, title=title, words=words)
        enqueue("author-stats-worker", [author_id])
    return post


async def apublish(author_id: int, title: str, words: int) -> Post:
    """The same from an async view (Django's async ORM runs in autocommit)."""
    post = await Post.objects.acreate(author_id=author_id, title=title, words=words)
    await aenqueue("author-stats-worker", [author_id])
    return post
