"""Puts ``scripts/`` on ``sys.path``, so that a benchmark run as ``python scripts/bench/x.py``
imports the parts it shares with the user scripts (`common`, `nets`). Import it before them::

    import scripts_path  # noqa: F401  (scripts/ on sys.path)
    from common import run_main
"""

import sys
from pathlib import Path

SCRIPTS = str(Path(__file__).resolve().parents[1])
if SCRIPTS not in sys.path:
    sys.path.append(SCRIPTS)
