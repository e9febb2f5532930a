"""Fixtures of the shared API suite; every test in ``tests/api`` carries the ``api`` marker.

The backend is whatever ``RDMASHIM_BACKEND`` names (default: the built-in
engine). ``device`` opens the backend's default device; ``cm`` gives an event
channel with a listener on a local address (``RDMASHIM_API_HOST``, default
127.0.0.1) that makes connected pairs on the device the route picks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from api.support import Cm, Pair

import rdmashim
from rdmashim.cm import EventChannel

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.api)


@pytest.fixture
async def device() -> AsyncIterator[Any]:
    """The backend's default device, opened."""
    async with rdmashim.open_device() as ctx:
        yield ctx


@pytest.fixture
async def cm() -> AsyncIterator[Cm]:
    """An event channel that makes connected pairs (see ``support.Cm``)."""
    async with EventChannel() as channel:
        yield Cm(channel)


@pytest.fixture
async def pair(cm: Cm) -> Pair:
    """A connected pair with the default capabilities."""
    return await cm.pair()
