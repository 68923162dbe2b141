"""The one patch helper every adapter uses: sync and async methods, one marker, undo-all."""

import asyncio

import pytest

from amem_callbacks.patching import Patches, is_wrapped


class Engine:
    def resume(self, x):
        return ("resume", x)

    async def suspend(self, x):
        return ("suspend", x)


def test_before_after_around_on_sync_and_async_methods_and_undo():
    seen = []
    patches = Patches()
    assert patches.wrap(Engine, "resume", before=lambda self, x: seen.append(("before", x)))
    assert patches.wrap(Engine, "suspend", after=lambda result, self, x: seen.append(result))
    assert not patches.wrap(Engine, "resume", before=print)  # never twice
    assert is_wrapped(Engine.resume) and is_wrapped(Engine.suspend)
    engine = Engine()
    assert engine.resume(1) == ("resume", 1)
    assert asyncio.run(engine.suspend(2)) == ("suspend", 2)
    assert seen == [("before", 1), ("suspend", 2)]
    assert asyncio.iscoroutinefunction(Engine.suspend)  # an async method stays one
    patches.add(Engine, "extra", lambda self: "added")
    assert engine.extra() == "added" and is_wrapped(Engine.extra)
    patches.undo()
    assert not is_wrapped(Engine.resume) and not hasattr(Engine, "extra")
    assert Engine().resume(3) == ("resume", 3)


def test_instance_patches_come_off_and_a_missing_required_method_says_which():
    engine = Engine()
    patches = Patches()
    patches.wrap(engine, "resume", lambda original, x: ("around", original(x)))
    assert engine.resume(4) == ("around", ("resume", 4))
    patches.undo()
    assert "resume" not in vars(engine) and engine.resume(5) == ("resume", 5)
    with pytest.raises(AttributeError, match="Engine.missing not found"):
        Patches().wrap(Engine, "missing", before=print, required=True)
