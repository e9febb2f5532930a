"""Shared fixtures: an opened siw_lo device and a connected pair of queue pairs on it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

import rdmashim

from pairs import Side, make_pair


@pytest.fixture
async def ctx() -> AsyncIterator[Any]:
    async with rdmashim.open_device("siw_lo") as c:
        yield c


@pytest.fixture
async def pair(ctx: Any) -> tuple[Side, Side]:
    return await make_pair(ctx)
