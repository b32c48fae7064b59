"""Old import paths of modules that moved into wings on 2026-12-03. `import parity.types` (and the
others in `MOVED`) keeps working for one release: it warns once (DeprecationWarning) and gives the
module at its new path, the same module object. docs/ARCHITECTURE.md lists them for removal."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

#: old path -> new path, for the modules users import by path.
MOVED = {
    "parity.types": "parity.core.types",
    "parity.tolerance": "parity.drift.tolerance",
    "parity.metrics": "parity.drift.metrics",
    "parity.dumps": "parity.rollouts.dumps",
    "parity.record": "parity.rollouts.record",
    "parity.cases": "parity.workload.cases",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        new = MOVED[module.__name__]
        # stacklevel 2 is the importing line: `warnings` skips the import machinery's frames itself
        warnings.warn(f"{module.__name__} moved to {new}; the old path is removed in the next release",
                      DeprecationWarning, stacklevel=2)
        # the import system returns what sys.modules holds under the name after exec_module
        sys.modules[module.__name__] = importlib.import_module(new)


def install() -> None:
    """Serve the old paths (once per interpreter)."""
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())
