"""``python -m mmreplay``: the same command as the ``mmreplay`` entry point."""

from .cli import main

raise SystemExit(main())
