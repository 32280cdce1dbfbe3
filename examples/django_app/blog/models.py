"""Authors, their posts, and the per-author figures pgjobs keeps."""

from django.db import models


class Author(models.Model):
    name = models.TextField()

    class Meta:
        db_table = "author"

    def __str__(self) -> str:
        return self.name


class Post(models.Model):
    author = models.ForeignKey(Author, on_delete=models.CASCADE)
    title = models.TextField()
    words = models.IntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        db_table = "post"

    def __str__(self) -> str:
        return self.title


class AuthorStats(models.Model):
    """Derived: written by the jobs of settings.PGJOBS, never by views."""

    author = models.OneToOneField(Author, on_delete=models.CASCADE, primary_key=True)
    posts = models.IntegerField()
    words = models.IntegerField()
    last_post_at = models.DateTimeField(null=True)

    class Meta:
        db_table = "author_stats"
        verbose_name_plural = "author stats"


class PostCounts(models.Model):
    """Derived: kept by the declared ``PGJOBS["derived"]["post-counts"]``,
    from any write to ``author`` or ``post`` (the triggers enqueue)."""

    author = models.OneToOneField(Author, on_delete=models.CASCADE, primary_key=True)
    posts = models.IntegerField()
    words = models.IntegerField()

    class Meta:
        db_table = "post_counts"
        verbose_name_plural = "post counts"
