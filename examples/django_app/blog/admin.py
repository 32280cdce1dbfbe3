from django.contrib import admin

from .models import Author, AuthorStats, Post


@admin.register(Author)
class AuthorAdmin(admin.ModelAdmin):
    list_display = ("id", "name")


@admin.register(Post)
class PostAdmin(admin.ModelAdmin):
    list_display = ("id", "author", "title", "words", "created_at")


@admin.register(AuthorStats)
class AuthorStatsAdmin(admin.ModelAdmin):
    """Read-only: pgjobs writes these rows."""

    list_display = ("author", "posts", "words", "last_post_at")

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
