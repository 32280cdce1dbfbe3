"""The app's Django migrations, one per pgjobs/sql file (written by
`python -m pgjobs.contrib.django.generate`)."""

__all__: list[str] = []
