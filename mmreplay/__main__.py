"""``python -m mmreplay``: the same command as the ``mmreplay`` entry point."""

from mmreplay.tools.cli import main

raise SystemExit(main())
