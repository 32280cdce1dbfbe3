"""``python -m pgjobs.cli``: the ``pgjobs`` command."""

from . import main

main()


__all__: list[str] = []
