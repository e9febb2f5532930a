"""The nursery helpers of ``verbs.tasks``: objects that own background tasks let the
caller's own exceptions out unwrapped, and work split into tasks raises its first error
as itself."""

from __future__ import annotations

import pytest
import trio

import rdmashim
from rdmashim.cm import EventChannel
from rdmashim.verbs.tasks import leaves, unwrapping_nursery


async def test_open_device_lets_exceptions_through() -> None:
    with pytest.raises(KeyError, match="mine"):
        async with rdmashim.open_device("siw_lo"):
            raise KeyError("mine")


async def test_event_channel_lets_exceptions_through() -> None:
    with pytest.raises(KeyError, match="mine"):
        async with EventChannel():
            raise KeyError("mine")


async def test_cancellation_still_works() -> None:
    with trio.move_on_after(0.01) as scope:
        async with rdmashim.open_device("siw_lo"), EventChannel():
            await trio.sleep_forever()
    assert scope.cancelled_caught


async def fail(exc: BaseException, after: float = 0.0) -> None:
    with trio.CancelScope(shield=True):  # fails even when another task failed first
        await trio.sleep(after)
    raise exc


async def test_a_tasks_error_comes_out_as_itself() -> None:
    with pytest.raises(KeyError) as caught:
        async with unwrapping_nursery() as nursery:
            nursery.start_soon(fail, KeyError("piece 3"))
            await trio.sleep(1)  # cancelled by the failure
    assert caught.value.__cause__ is None


async def test_the_bodys_error_comes_out_as_itself() -> None:
    with pytest.raises(EOFError):
        async with unwrapping_nursery() as nursery:
            nursery.start_soon(trio.sleep, 1)
            raise EOFError("the source ended")


async def test_several_errors_give_the_first_with_the_group_as_its_cause() -> None:
    with pytest.raises(ValueError, match="first") as caught:
        async with unwrapping_nursery() as nursery:
            nursery.start_soon(fail, ValueError("first"))
            nursery.start_soon(fail, OSError("second"), 0.01)
    group = caught.value.__cause__
    assert isinstance(group, BaseExceptionGroup)
    assert sorted(type(e).__name__ for e in leaves(group)) == ["OSError", "ValueError"]


async def test_a_cancellation_from_outside_passes_as_it_came() -> None:
    with trio.move_on_after(0.01) as scope:
        async with unwrapping_nursery() as nursery:
            nursery.start_soon(trio.sleep, 10)
            await trio.sleep(10)
    assert scope.cancelled_caught


def test_leaves_flattens_nested_groups_in_order() -> None:
    a, b, c = KeyError(1), ValueError(2), OSError(3)
    assert leaves(ExceptionGroup("x", [a, ExceptionGroup("y", [b, c])])) == [a, b, c]
    assert leaves(a) == [a]
