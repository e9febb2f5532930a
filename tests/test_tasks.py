"""Objects that own background tasks let the caller's own exceptions out unwrapped."""

from __future__ import annotations

import pytest
import trio

import rdmashim
from rdmashim.cm import EventChannel


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
