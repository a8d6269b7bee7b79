"""Old module paths, kept for one release after the modules moved into subpackages.

``import mmreplay.frame_store`` (or any path in `MOVED`) still works: it returns the module
at its new path, under both names, and warns once with `DeprecationWarning` naming the new
path. Remove this file, and its test, in the release after 0.2.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {
    "mmreplay.frame_store": "mmreplay.storage.frame_store",
    "mmreplay.shards": "mmreplay.storage.shards",
    "mmreplay.codec": "mmreplay.storage.codec",
    "mmreplay.commit": "mmreplay.storage.commit",
    "mmreplay.manifest": "mmreplay.storage.manifest",
    "mmreplay.layout": "mmreplay.storage.layout",
    "mmreplay.safe_io": "mmreplay.storage.safe_io",
    "mmreplay.ring": "mmreplay.index.ring",
    "mmreplay.samplers": "mmreplay.index.samplers",
    "mmreplay.sum_tree": "mmreplay.index.sum_tree",
    "mmreplay.sequences": "mmreplay.index.sequences",
    "mmreplay.seq_reader": "mmreplay.sequence_reader",
    "mmreplay.lazy": "mmreplay.kernels",
    "mmreplay.dopamine": "mmreplay.datasets.dopamine",
    "mmreplay.episodes": "mmreplay.datasets.episodes",
    "mmreplay.staging": "mmreplay.datasets.staging",
    "mmreplay.integrations.minari": "mmreplay.datasets.minari",
    "mmreplay.cli": "mmreplay.tools.cli",
    "mmreplay.cli_datasets": "mmreplay.tools.cli_datasets",
    "mmreplay.inspect": "mmreplay.tools.inspection",
    "mmreplay.verify": "mmreplay.tools.verify",
}


class _MovedLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self._new = new
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self._new}; import it from there "
                      f"(the old path goes away in the next release)",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self._new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the alias spec on the real module; give it its own back.
        module.__spec__ = self._spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _MovedLoader(new))


def install() -> None:
    """Put the finder for old paths on `sys.meta_path` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
