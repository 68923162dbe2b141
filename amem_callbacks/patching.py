"""How adapters hook into a framework without editing it: wrapped methods that
can all be undone, and actions that run right after a module is first imported.

One marker attribute (``__amem_original__``) on every wrapper: it makes wrapping
idempotent (a class is never wrapped twice, whoever asks) and names the original.
The marker holds the original in an :class:`Original`, which pickles to an empty
one: Ray's tracing wraps every actor method with ``functools.wraps``, which copies
the marker into its own wrapper, and cloudpickle sends that wrapper by value. The
original is no longer importable under its own name (the wrapper took its place),
so it would go by value too, closures and all, and verl 0.9.1's does not pickle
("cannot pickle 'ConfigModuleInstance'": every verl job died at its first worker
group, measured on an H100). The process that unpickles has its own wrappers.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
from typing import Callable, Optional

MARK = "__amem_original__"
#: the marker's value on an attribute the adapter added (there is no original)
ADDED = "added by amem_callbacks"


class Original:
    """The marker's value: the function a wrapper replaced (None once pickled)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __reduce__(self):
        return Original, (None,)


def mark(new, original) -> None:
    """Mark ``new`` as the wrapper of ``original`` (or ADDED): see the module's note."""
    setattr(new, MARK, Original(original))


def original_of(fn):
    """The function ``fn`` wraps, ADDED for an added attribute, None for neither."""
    held = getattr(fn, MARK, None)
    return held.fn if isinstance(held, Original) else None


def is_wrapped(fn) -> bool:
    """True for a wrapper or an attribute an adapter put in place."""
    return getattr(fn, MARK, None) is not None


def wrapper(original: Callable, around: Callable) -> Callable:
    """``around(original, *args, **kwargs)`` in the shape of ``original``: a
    coroutine function stays one (``around`` may then be sync or async)."""
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def wrapped(*args, **kwargs):
            result = around(original, *args, **kwargs)
            return await result if inspect.isawaitable(result) else result
    else:
        @functools.wraps(original)
        def wrapped(*args, **kwargs):
            return around(original, *args, **kwargs)
    mark(wrapped, original)
    return wrapped


class Patches:
    """Replacements an adapter made; ``undo`` restores every one, last first.

    Example:
        >>> patches = Patches()
        >>> patches.wrap(trainer, "_generate", lambda original, *a, **k: original(*a, **k))
        >>> patches.undo()
    """

    def __init__(self):
        self._done: list = []  # (owner, name, previous value or None, owned by owner's __dict__)

    def wrap(self, owner, name: str, around: Optional[Callable] = None, *,
             before: Optional[Callable] = None, after: Optional[Callable] = None,
             replace: Optional[Callable] = None, required: bool = False) -> bool:
        """Wrap ``owner.name``; returns False when there is nothing to wrap or it
        is wrapped already.

        Args:
            around: ``around(original, *args, **kwargs)`` runs instead of it.
            before: ``before(*args, **kwargs)`` runs first.
            after: ``after(result, *args, **kwargs)`` runs after it returned.
            replace: ``replace(original) -> new callable``, for wrappers that
                need the original's own decorators re-applied.
            required: raise AttributeError when ``owner`` has no ``name``.
        """
        # a class: only its own method (wrapping an inherited one would shadow it)
        original = (owner.__dict__.get(name) if isinstance(owner, type)
                    else getattr(owner, name, None))
        if original is None:
            if required:
                raise AttributeError(f"{getattr(owner, '__name__', type(owner).__name__)}.{name} "
                                     "not found")
            return False
        if is_wrapped(original):
            return False
        if replace is not None:
            new = replace(original)
            mark(new, original)
        else:
            new = wrapper(original, around or _before_after(before, after))
        self._done.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, new)
        return True

    def add(self, owner, name: str, value) -> None:
        """Give ``owner`` a new attribute (removed again by ``undo``)."""
        if name in vars(owner):
            return
        mark(value, ADDED)
        self._done.append((owner, name, None, False))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._done:
            owner, name, original, owned = self._done.pop()
            if owned:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def _before_after(before: Optional[Callable], after: Optional[Callable]) -> Callable:
    def around(original, *args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if inspect.isawaitable(result) and after is not None:
            return _then(result, after, args, kwargs)
        if after is not None:
            after(result, *args, **kwargs)
        return result
    return around


async def _then(awaitable, after: Callable, args, kwargs):
    result = await awaitable
    after(result, *args, **kwargs)
    return result


# --- running code right after a module's first import ------------------------
# The adapters wrap framework classes often before the framework is imported
# (verl loads our entry point first; Megatron-LM's RL module may never be
# imported). A sys.meta_path finder hands only the watched modules to a loader
# that runs the real loader, then the actions.
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


def when_imported(name: str, action: Callable) -> None:
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


class ImportHooks:
    """An adapter's hooks: ``{module name: action(module)}``, each run right after
    its module's import (:func:`when_imported`) once ``install`` ran (again: no-op);
    ``remove`` undoes ``patches`` and drops the actions still waiting.

    ``on_error(name, exc)`` hears of an action that raised; without it the
    exception reaches the import that ran the action.
    """

    def __init__(self, actions: dict, on_error: Optional[Callable] = None):
        self.actions = actions
        self.on_error = on_error
        self.patches = Patches()
        self.installed = False
        self._lock = threading.Lock()

    def install(self) -> None:
        with self._lock:
            if self.installed:
                return
            self.installed = True
        for name in self.actions:
            when_imported(name, functools.partial(self._run, name))

    def _run(self, name: str, module) -> None:
        try:
            self.actions[name](module)
        except Exception as exc:
            if self.on_error is None:
                raise
            self.on_error(name, exc)

    def remove(self) -> None:
        with self._lock:
            self.patches.undo()
            forget(self.actions)
            self.installed = False
