"""Shared fixtures: an opened siw_lo device, a connected pair of queue pairs on it, three
hosts in network namespaces, and whether the siw guest tests can capture."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import siwvm

import rdmashim

import netns
from pairs import Side, make_pair


@pytest.fixture
async def ctx() -> AsyncIterator[Any]:
    async with rdmashim.open_device("siw_lo") as c:
        yield c


@pytest.fixture
async def pair(ctx: Any) -> tuple[Side, Side]:
    return await make_pair(ctx)


@pytest.fixture(scope="module")
def net() -> Iterator[netns.Network]:
    """Three hosts in network namespaces (tests/netns.py), built once per module."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    netns.sweep_stale()
    network = netns.Network.build()
    try:
        yield network
    finally:
        network.destroy()


@pytest.fixture
def netns_tcpdump() -> bool:
    """Whether the siw guest tests can capture the bridge (see ``siwvm.can_capture``)."""
    return siwvm.can_capture()
