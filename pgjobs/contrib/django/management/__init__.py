"""manage.py commands of the pgjobs app."""

__all__: list[str] = []
