"""What a user sees when importing: each package's ``__all__`` is its public names, no
helper leaks (``annotations``, ``AsyncIterator``, ...), every public class says what it
is, and ``help()`` on the CM's connection objects documents their fields and hides the
private ones."""

from __future__ import annotations

import importlib
import inspect
import pydoc
import re
import struct
import types

import pytest

from rdmashim.cm import CMEvent, Connection, ConnectionRequest

PACKAGES = ["rdmashim", "rdmashim.verbs", "rdmashim.cm", "rdmashim.ulps.rds"]


def _exported(package: str) -> list[tuple[str, object]]:
    module = importlib.import_module(package)
    return [(name, getattr(module, name)) for name in module.__all__]


@pytest.mark.parametrize("package", PACKAGES)
def test_all_names_resolve_and_star_import_gives_them(package: str) -> None:
    module = importlib.import_module(package)
    names = list(module.__all__)
    assert len(names) == len(set(names)), f"{package}.__all__ names a name twice"
    missing = [name for name in names if not hasattr(module, name)]
    assert not missing, f"{package}.__all__ names what it lacks: {missing}"
    star: dict[str, object] = {}
    exec(f"from {package} import *", star)
    assert sorted(set(star) - {"__builtins__"}) == sorted(names)


@pytest.mark.parametrize("package", PACKAGES)
def test_dir_shows_the_public_api_and_submodules_only(package: str) -> None:
    """A public-looking name outside ``__all__`` is a leak, unless it is a submodule
    of the package (``rdmashim.cm``, ``rdmashim.ulps.rds.wire``)."""
    module = importlib.import_module(package)
    leaks = [
        name
        for name in dir(module)
        if not name.startswith("_")
        and name not in module.__all__
        and not (
            isinstance(getattr(module, name), types.ModuleType)
            and getattr(module, name).__name__ == f"{package}.{name}"
        )
    ]
    assert not leaks, f"{package} shows helper names: {leaks}"


@pytest.mark.parametrize("package", PACKAGES)
def test_exports_are_ours_and_documented(package: str) -> None:
    """Each exported class or function is defined in rdmashim (no typing or standard
    library helper re-exported) and carries a docstring of its own (not the signature
    a dataclass writes when there is none); a constant is a plain value or a layout
    (``WC_ROW``, a ``struct.Struct``)."""
    for name, obj in _exported(package):
        if name == "__version__":
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            assert obj.__module__.split(".")[0] == "rdmashim", f"{package}.{name}: {obj.__module__}"
            doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
            assert doc and not doc.startswith(f"{obj.__name__}("), f"{package}.{name}: no docstring"
        else:
            constant = int | str | bytes | struct.Struct
            assert isinstance(obj, constant), f"{package}.{name} is {type(obj)}"


PUBLIC_FIELDS = {
    Connection: ["id", "pd", "qp", "cq", "send_cq", "recv_cq", "private_data", "context",
                 "local_addr", "peer_addr", "wait_disconnected", "aclose"],
    ConnectionRequest: ["id", "pd", "qp", "cq", "send_cq", "recv_cq", "private_data",
                        "param", "accept", "reject", "peer_addr"],
    CMEvent: ["event", "id", "status", "private_data", "param", "listen_id", "detail",
              "reason", "ack"],
}  # fmt: skip
PRIVATE = ["_router", "_resources", "_channel", "_connection", "_answered", "_setup_failure",
           "_disconnected", "_closed", "_released"]  # fmt: skip


@pytest.mark.parametrize("cls", list(PUBLIC_FIELDS), ids=lambda cls: cls.__name__)
def test_help_documents_public_fields_and_hides_private_ones(cls: type) -> None:
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    lines = text.splitlines()
    for name in PUBLIC_FIELDS[cls]:
        at = [
            i
            for i, line in enumerate(lines)
            if line.strip(" |").removeprefix("async ").startswith(name)
        ]
        assert at, f"help({cls.__name__}) does not show {name}"
        documented = any(lines[i + 1].strip(" |") for i in at if i + 1 < len(lines))
        assert documented, f"help({cls.__name__}) shows {name} without a word on it"
    shown = [name for name in PRIVATE if re.search(rf"(?<!\w){name}\b", text)]
    assert not shown, f"help({cls.__name__}) shows private attributes: {shown}"
