"""Run code right after a framework module is first imported.

The adapters wrap framework classes without editing the framework, often
before it is imported (verl loads our entry point first; Megatron-LM's RL
module may never be imported at all). A ``sys.meta_path`` finder hands only the
watched modules to a loader that runs the real loader, then the actions.
"""

from __future__ import annotations

import sys
import threading

_lock = threading.Lock()


class _Loader:
    """Delegates to the real loader; runs the actions after the module ran."""

    def __init__(self, loader, actions):
        self._loader = loader
        self._actions = actions

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for action in self._actions:
            action(module)

    def __getattr__(self, name):  # get_source, get_code, is_package ... of the real loader
        return getattr(self._loader, name)


class _AfterImport:
    """A finder that only touches the modules someone is waiting for."""

    def __init__(self):
        self.pending = {}

    def find_spec(self, name, path=None, target=None):
        if name not in self.pending:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            with _lock:
                actions = self.pending.pop(name, [])
            spec.loader = _Loader(spec.loader, actions)
        return spec


_finder = _AfterImport()


def when_imported(name: str, action) -> None:
    """Run ``action(module)`` now if ``name`` is imported, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        action(module)
        return
    with _lock:
        _finder.pending.setdefault(name, []).append(action)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def forget(names) -> None:
    """Drop the actions still waiting for ``names`` (for tests that undo hooks)."""
    with _lock:
        for name in names:
            _finder.pending.pop(name, None)
        if not _finder.pending and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
