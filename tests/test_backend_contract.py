"""The backend contract: every backend's Backend object and the registry.

The registry (:mod:`rdmashim.verbs.backend`, re-exported as
:mod:`rdmashim.registry`) hands out :class:`~rdmashim.verbs.backend.Backend`
objects; each available backend lists devices that open, says why it is
(un)available, and gives the event channel a connector
(:class:`~rdmashim.cm.abc.CMBackend`) whose ids take the portable transport
options it names. That no layer imports what it must not, in every folder, is
``test_layers.py``'s.
"""

from __future__ import annotations

import sys
import types

import pytest
import trio

import rdmashim
from rdmashim import registry
from rdmashim.cm import EventChannel, TransportOptions
from rdmashim.cm.abc import CMBackend
from rdmashim.registry import BACKENDS, BackendInfo, backend_status, load_backend
from rdmashim.verbs import backend as verbs_backend
from rdmashim.verbs.errors import BackendUnavailable, NotSupported, VerbsError


def _available() -> list[str]:
    return [info.name for info, reason in backend_status() if reason is None]


# ---------------------------------------------------------------- Backend objects


def test_registry_hands_out_backend_objects_named_as_registered() -> None:
    for info, reason in backend_status():
        try:
            backend = load_backend(info.name)
        except BackendUnavailable:
            assert reason is not None  # an unimportable backend says why
            continue
        assert backend.name == info.name
        assert backend.description
        assert info.module.endswith(f".{backend.name}")
        assert backend.transport_options <= set(TransportOptions.__dataclass_fields__)


def test_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(BackendUnavailable, match="unknown rdmashim backend 'nope'"):
        load_backend("nope")


def test_every_registered_backend_reports_a_status() -> None:
    assert [info.name for info, _ in backend_status()] == list(BACKENDS)
    assert "softiwarp" in _available()


@pytest.mark.parametrize("name", sorted(BACKENDS))
async def test_available_backend_lists_devices_that_open(name: str) -> None:
    if name not in _available():
        reasons = {info.name: reason for info, reason in backend_status()}
        pytest.skip(f"{name} is unavailable here: {reasons[name]}")
    backend = load_backend(name)
    assert backend.unavailable_reason() is None
    devices = backend.get_device_list()
    assert devices, f"{name} is available but lists no device"
    assert all(dev.backend == name for dev in devices)
    assert [d.name for d in rdmashim.get_device_list(backend=name)] == [d.name for d in devices]
    async with backend.open_device(devices[0].name) as ctx:
        assert ctx.backend == name and ctx.device.name == devices[0].name
        assert ctx.query_device().max_qp_wr > 0
        pd = ctx.alloc_pd()
        mr = pd.reg_mr(bytearray(64))
        assert mr.pd is pd and mr.length == 64
    with pytest.raises(VerbsError):
        async with backend.open_device("no-such-device"):
            pass


@pytest.mark.parametrize("name", sorted(BACKENDS))
async def test_connector_ids_take_the_options_the_backend_honours(name: str) -> None:
    if name not in _available():
        pytest.skip(f"{name} is unavailable here")
    backend = load_backend(name)
    try:
        channel = EventChannel(backend=name)
        await channel.__aenter__()
    except BackendUnavailable as exc:  # e.g. rdma-core without the kernel's rdma_cm
        pytest.skip(f"{name} has no CM here: {exc}")
    try:
        cm_id = channel.create_id()
        assert cm_id.options == TransportOptions()
        for option, value in (("crc", False), ("p2p", True), ("revision", 1)):
            wanted = TransportOptions(**{option: value})
            if option in backend.transport_options:
                cm_id.options = wanted
                assert cm_id.options == wanted
            else:
                with pytest.raises(NotSupported):
                    cm_id.options = wanted
        cm_id.destroy()
    finally:
        await channel.__aexit__(None, None, None)


async def test_objects_of_another_backend_are_refused() -> None:
    class Foreign:
        """Not a CQ of any backend."""

    async with rdmashim.open_device(backend="softiwarp") as ctx:
        pd = ctx.alloc_pd()
        cq = ctx.create_cq(4)
        with pytest.raises(VerbsError, match="not a CQ of this backend"):
            pd.create_qp(send_cq=Foreign(), recv_cq=cq)  # type: ignore[arg-type]
    await trio.lowlevel.checkpoint()


def test_transport_options_name_what_differs() -> None:
    assert TransportOptions().non_default() == frozenset()
    assert TransportOptions(crc=False, p2p=True).non_default() == {"crc", "p2p"}
    with pytest.raises(ValueError, match="revision 3"):
        TransportOptions(revision=3)


@pytest.mark.parametrize(
    "fault",
    [{"revision": True}, {"crc": "yes"}, {"p2p": 5}, {"rtr": 6}, {"max_fpdu": 1.5}],
    ids=repr,
)
def test_transport_options_of_the_wrong_type_are_refused(fault: dict) -> None:
    """A truthy string is no CRC flag, an int no RTR set (``RTR(6)`` is): refused when
    made, naming the field, rather than taken as what it happens to mean."""
    with pytest.raises(ValueError, match=next(iter(fault)) if "revision" not in fault else "MPA"):
        TransportOptions(**fault)


# ---------------------------------------------------------------- where the registry lives


def test_the_facade_registry_is_the_verbs_registry() -> None:
    """``rdmashim.registry`` re-exports the registry of :mod:`rdmashim.verbs.backend`, so
    a name users import from either is one object (the CM and IBAL use the latter)."""
    for name in registry.__all__:
        assert getattr(registry, name) is getattr(verbs_backend, name), name
    assert rdmashim.chosen_backend is verbs_backend.chosen_backend


async def test_a_backend_without_rdma_cm_is_refused_by_the_event_channel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The event channel asks for the CM part of a backend (``CMBackend``) by what the
    object offers, not by its name: a verbs-only backend is unavailable to it, and says so."""
    softiwarp = load_backend("softiwarp")

    class VerbsOnly:
        """The verbs part of the built-in backend, without its connector."""

        name = "verbsonly"
        description = "the built-in engine's verbs, no rdma_cm"
        get_device_list = softiwarp.get_device_list
        open_device = softiwarp.open_device
        unavailable_reason = softiwarp.unavailable_reason

    package = types.ModuleType("verbsonly")
    package.BACKEND = VerbsOnly()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "verbsonly", package)
    monkeypatch.setitem(BACKENDS, "verbsonly", BackendInfo("verbsonly", "verbsonly"))
    assert isinstance(softiwarp, CMBackend) and not isinstance(package.BACKEND, CMBackend)
    with pytest.raises(BackendUnavailable, match="backend 'verbsonly' offers no rdma_cm"):
        async with EventChannel(backend="verbsonly"):
            pass
