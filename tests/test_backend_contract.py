"""The backend contract: every backend's Backend object, the registry, and the seams.

The registry hands out :class:`rdmashim.verbs.backend.Backend` objects; each
available backend lists devices that open, says why it is (un)available, and
gives the event channel a connector whose ids take the portable transport
options it names. The architectural tests read the sources (``ast``) and hold
the layers apart: ``cm/`` names no backend and not the facade, no backend
imports another, and the facade reaches backends only through the registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import trio

import rdmashim
from rdmashim.cm import EventChannel, TransportOptions
from rdmashim.registry import BACKENDS, backend_status, load_backend
from rdmashim.verbs.errors import BackendUnavailable, NotSupported, VerbsError

REPO = Path(__file__).resolve().parents[1]
BACKEND_PACKAGES = sorted(
    p.name for p in (REPO / "verbs").iterdir() if (p / "__init__.py").exists()
)
"""Every backend package under verbs/ (a package there is a backend)."""


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


# ---------------------------------------------------------------- the seams


def _imports(path: Path) -> list[str]:
    """Every module ``path`` imports (absolute names; relative ones resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            assert node.module is not None
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def _sources(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def _backend_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] == ["rdmashim", "verbs"] and len(parts) > 2 and parts[2] in BACKEND_PACKAGES:
        return parts[2]
    return None


def test_the_seam_checker_sees_backend_imports() -> None:
    assert {"softiwarp", "rdmacore"} <= set(BACKEND_PACKAGES)
    assert _backend_of("rdmashim.verbs.softiwarp.provider") == "softiwarp"
    assert _backend_of("rdmashim.verbs.abc") is None
    assert "rdmashim.verbs.softiwarp.cm_id" in _imports(REPO / "verbs/softiwarp/backend.py")


def test_cm_names_no_backend_and_not_the_facade() -> None:
    for path in _sources("cm"):
        for module in _imports(path):
            assert module != "rdmashim", f"{path.relative_to(REPO)} imports the facade"
            assert _backend_of(module) is None, f"{path.relative_to(REPO)} imports {module}"


def test_no_backend_imports_another() -> None:
    for name in BACKEND_PACKAGES:
        for path in _sources(f"verbs/{name}"):
            for module in _imports(path):
                other = _backend_of(module)
                assert other in (None, name), f"{path.relative_to(REPO)} imports {module}"
                assert module != "rdmashim", f"{path.relative_to(REPO)} imports the facade"


def test_facade_reaches_backends_only_through_the_registry() -> None:
    for path in sorted((REPO / "rdmashim").glob("*.py")):
        for module in _imports(path):
            assert _backend_of(module) is None, f"{path.relative_to(REPO)} imports {module}"
