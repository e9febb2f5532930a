"""Shared fixtures: an opened siw_lo device, a connected pair of queue pairs on it, three
hosts in network namespaces, and whether the siw guest tests can capture; and the reason
of a skip inside a trio test kept (pytest-trio 0.8 re-raises it without one)."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import siwvm
from _pytest.outcomes import Skipped

import rdmashim
from rdmashim.providers.softiwarp import engines, fastpath, native
from rdmashim.ulps.rds import plain

import netns
from pairs import Side, make_pair


def pytest_configure(config: pytest.Config) -> None:
    """A suite started in the background of a non-interactive shell (``cmd &``) has
    SIGINT ignored, and every process it starts would ignore it too: the tests that
    press Ctrl-C on a command (tests/test_cli_errors.py) would see it go unheard.
    Handled here, it is reset to the default in each child at exec."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Any:
    """A ``pytest.skip(reason)`` inside a trio test reports its reason."""
    try:
        return (yield)
    except Skipped as exc:
        group = exc.__context__
        leaves = group.exceptions if isinstance(group, BaseExceptionGroup) else ()
        while len(leaves) == 1 and isinstance(leaves[0], BaseExceptionGroup):
            leaves = leaves[0].exceptions
        if exc.msg or len(leaves) != 1 or not isinstance(leaves[0], Skipped):
            raise
        raise leaves[0] from None


@pytest.fixture(scope="module", params=["compiled", "python"])
def engine_kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a module once with the engine's compiled kernels and once with the Python ones
    (``fastpath.use``: engines created meanwhile take them). Module-scoped, so hypothesis
    tests may use it; the compiled run skips, saying why, when they are unavailable."""
    if request.param == "compiled" and fastpath.COMPILED is None:
        pytest.skip(f"compiled kernels unavailable: {fastpath.WHY_NOT}")
    before = fastpath.use(request.param == "compiled")
    engine = os.environ.get(engines.ENV_ENGINE)
    os.environ[engines.ENV_ENGINE] = "python"  # the kernels are the Python engine's
    try:
        yield request.param
    finally:
        fastpath.restore(before)
        if engine is None:
            os.environ.pop(engines.ENV_ENGINE, None)
        else:
            os.environ[engines.ENV_ENGINE] = engine


@pytest.fixture(params=["native", "python"])
def each_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on the native engine and on the Python one (its kernels compiled when
    built): devices opened during it, in this process or a child, get that engine."""
    if request.param == "native" and not native.AVAILABLE:
        pytest.skip(f"native engine unavailable: {native.WHY_NOT}")
    monkeypatch.setenv(engines.ENV_ENGINE, request.param)
    return str(request.param)


@pytest.fixture(params=["c", "python"])
def rds_paths(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with RDS's plain-message path in C and with the Python one
    (``plain.use``: nodes made meanwhile take it); the C run skips, saying why, when it
    was not built."""
    if request.param == "c" and plain.COMPILED is None:
        pytest.skip(f"RDS's plain-message path in C unavailable: {plain.WHY_NOT}")
    before = plain.compiled()
    plain.use(request.param == "c")
    try:
        yield str(request.param)
    finally:
        plain.use(before)


@pytest.fixture
def python_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test looks into the Python engine's provider: devices open with that engine."""
    monkeypatch.setenv(engines.ENV_ENGINE, "python")


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
