"""Fixtures of the IBAL facade tests: an open AL, its loopback CA, a PD (helpers: ``support``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ibal.support import loopback_guid

from rdmashim.providers.ibal import (
    IbAl,
    IbCa,
    IbPd,
    ib_alloc_pd,
    ib_close_al,
    ib_open_al,
    ib_open_ca,
)


@pytest.fixture
def al() -> Iterator[IbAl]:
    """An open access layer, closed (with all it holds) after the test."""
    h_al = ib_open_al()
    try:
        yield h_al
    finally:
        if not h_al._closed:
            ib_close_al(h_al)


@pytest.fixture
def ca(al: IbAl) -> IbCa:
    """The loopback CA, opened."""
    return ib_open_ca(al, loopback_guid(al))


@pytest.fixture
def pd(ca: IbCa) -> IbPd:
    return ib_alloc_pd(ca)
