"""The layers hold in every folder: each module in one layer, each import along an allowed arrow.

The package installs from several folders (``pyproject.toml``'s ``package-dir``:
``verbs/`` as ``rdmashim/verbs``, ``cm/`` as ``rdmashim/cm`` ...). :data:`LAYERS`
puts every module, by its installed path, in exactly one layer; :data:`ARROWS`
are the imports one layer may make of another, bottom up: the portable API
(verbs, then CM) at the bottom, the backends and the ULPs above it, the facade
and the tools on top. Every other arrow is refused, and :data:`NEVER` says why
for the ones that matter most. Imports are read with ``ast`` wherever they stand
(module level, ``if TYPE_CHECKING:``, inside a function), so a lazy import is no
way around a rule.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rdmashim.verbs.backend import BACKENDS

REPO = Path(__file__).resolve().parents[1]

LAYERS: dict[str, tuple[str, ...]] = {
    "Verbs": ("rdmashim/verbs/",),
    "CM": ("rdmashim/cm/",),
    "Engine": ("rdmashim/providers/softiwarp/",),
    "RdmaCore": ("rdmashim/providers/rdmacore/",),
    "Ibal": ("rdmashim/providers/ibal/",),
    "ULPs": ("rdmashim/ulps/__init__.py",),
    "RDS": ("rdmashim/ulps/rds/",),
    "NFS": ("rdmashim/ulps/nfsrdma/",),
    "Providers": ("rdmashim/providers/__init__.py",),
    "Facade": ("rdmashim/__init__.py", "rdmashim/moved.py", "rdmashim/registry.py"),
    "Tools": (
        "rdmashim/__main__.py", "rdmashim/cli.py", "rdmashim/cliargs.py",
        "rdmashim/clisignals.py", "rdmashim/demo.py", "rdmashim/devinfo.py", "rdmashim/ping.py",
        "rdmashim/ping_defaults.py", "rdmashim/perftools/", "rdmashim/rdstools/",
        "rdmashim/nfstools/",
    ),
}  # fmt: skip
"""Every module of the installed package, by path, in its layer: a file by name, or a
folder (``/`` at the end) with everything under it. A file in none fails the test, so a
new module is placed here on purpose."""

_BACKENDS = ("Engine", "RdmaCore", "Ibal")
_ULPS = ("RDS", "NFS")

ARROWS: frozenset[tuple[str, str]] = frozenset(
    [("CM", "Verbs")]
    + [(backend, below) for backend in _BACKENDS for below in ("Verbs", "CM")]
    + [(ulp, below) for ulp in _ULPS for below in ("Verbs", "CM")]
    + [("Facade", "Verbs"), ("Facade", "CM")]
    + [("Tools", below) for below in ("Verbs", "CM", "RDS", "NFS", "Facade")]
)
"""The imports a layer may make of another (within a layer, anything goes). A backend is
reached only by name, through the registry (:mod:`rdmashim.verbs.backend`)."""

_LOW = ("Verbs", "CM", *_BACKENDS)
_IBAL = "IBAL runs over any HCA through the contract"

NEVER: dict[tuple[str, str], str] = {
    **{(api, b): "the portable API names no backend" for api in ("Verbs", "CM") for b in _BACKENDS},
    ("Verbs", "CM"): "verbs know nothing of connection management",
    **{(ulp, b): "ULPs use only the portable API" for ulp in _ULPS for b in _BACKENDS},
    ("Engine", "RdmaCore"): "backends are independent",
    ("RdmaCore", "Engine"): "backends are independent",
    ("Ibal", "Engine"): _IBAL,
    ("Ibal", "RdmaCore"): _IBAL,
    **{(low, ulp): "lower layers know no ULP" for low in _LOW for ulp in _ULPS},
    **{(low, top): "no reaching up" for low in (*_LOW, *_ULPS) for top in ("Facade", "Tools")},
}
"""Why an arrow is refused, for the arrows the design names (``ARCHITECTURE.md``, "Layers
read bottom-up"); any other arrow outside :data:`ARROWS` is refused as not allowed."""


@dataclass(frozen=True, slots=True)
class Import:
    """One import of a module of the package: where it stands and what it names."""

    file: str
    """The importing module's installed path (``rdmashim/cm/channel.py``)."""
    line: int
    target: str
    """The module imported (``rdmashim.registry``); for ``from M import n`` the submodule
    ``M.n`` where there is one, else ``M``."""


# ---------------------------------------------------------------- the checker


def setuptools_config() -> dict[str, Any]:
    """``[tool.setuptools]`` of ``pyproject.toml``: what installs, from which folders."""
    config: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]
    setuptools: dict[str, Any] = config["setuptools"]
    return setuptools


def installed_sources() -> dict[str, Path]:
    """Every ``.py`` file of every folder the package installs from, by installed path."""
    config = setuptools_config()
    found: dict[str, Path] = {}
    for package, folder in config["package-dir"].items():
        for path in sorted((REPO / folder).rglob("*.py")):
            found[f"{package.replace('.', '/')}/{path.relative_to(REPO / folder)}"] = path
    return found


def layers_of(file: str) -> list[str]:
    """The layers whose entries take ``file`` (an installed path): one, if the table is right."""
    return [
        name
        for name, entries in LAYERS.items()
        if any(file == e or (e.endswith("/") and file.startswith(e)) for e in entries)
    ]


def module_file(target: str, files: Iterable[str]) -> str | None:
    """The installed file that holds module ``target``, or its nearest package (a compiled
    module such as ``_accel`` lives in its package); None outside the package."""
    known = set(files)
    parts = target.split(".")
    while parts:
        stem = "/".join(parts)
        for candidate in (f"{stem}.py", f"{stem}/__init__.py"):
            if candidate in known:
                return candidate
        parts.pop()
    return None


def imports_in(source: str, file: str, files: Iterable[str]) -> Iterator[Import]:
    """Every import in ``source`` (the module at installed path ``file``) of a module of
    the package, wherever it stands; relative imports resolved."""
    known = set(files)
    package = file.rsplit("/", 1)[0].split("/")
    for node in ast.walk(ast.parse(source, file)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "rdmashim":
                    yield Import(file, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if module.split(".")[0] != "rdmashim":
                continue
            targets: dict[str, None] = {}
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                is_module = module_file(sub, known) not in (None, module_file(module, known))
                targets[sub if is_module else module] = None
            yield from (Import(file, node.lineno, target) for target in targets)


def refusals(found: Iterable[Import], files: Iterable[str]) -> list[str]:
    """What breaks the layers, one line each naming the file, the import and the rule."""
    known = sorted(set(files))
    out = []
    for file in known:
        where = layers_of(file)
        if len(where) != 1:
            out.append(f"{file} is in {len(where)} layers {where}: put it in exactly one of LAYERS")
    for imp in found:
        target_file = module_file(imp.target, known)
        if target_file is None:
            continue
        src, dst = _layer(imp.file), _layer(target_file)
        if src == dst or (src, dst) in ARROWS:
            continue
        rule = NEVER.get((src, dst), f"{src} may import only {_allowed(src)}")
        out.append(f"{imp.file}:{imp.line} imports {imp.target} ({src} -> {dst}): {rule}")
    return out


def loops(found: Iterable[Import], files: Iterable[str], folder: str) -> list[list[str]]:
    """The modules of ``folder`` (an installed path ending in ``/``; its package faces,
    ``__init__.py``, left out) that import one another in a loop, directly or through
    others of the folder: each loop's modules, sorted."""
    known = sorted(set(files))
    edges: dict[str, set[str]] = {f: set() for f in known if _in_folder(f, folder)}
    for imp in found:
        target = module_file(imp.target, known)
        if imp.file in edges and target in edges and target != imp.file:
            edges[imp.file].add(target)
    reach = {file: _reach(edges, file) for file in edges}
    out: list[list[str]] = []
    for start, reached in reach.items():
        if start in reached and not any(start in loop for loop in out):
            out.append(sorted(n for n in reached if start in reach[n]))
    return out


def _in_folder(file: str, folder: str) -> bool:
    return file.startswith(folder) and not file.endswith("/__init__.py")


def _reach(edges: dict[str, set[str]], start: str) -> set[str]:
    reached: set[str] = set()
    todo = list(edges[start])
    while todo:
        node = todo.pop()
        if node not in reached:
            reached.add(node)
            todo.extend(edges[node])
    return reached


def _layer(file: str) -> str:
    return "/".join(layers_of(file)) or "no layer"


def _allowed(layer: str) -> str:
    return ", ".join(sorted(dst for src, dst in ARROWS if src == layer)) or "itself"


def _package_imports() -> tuple[list[Import], list[str]]:
    sources = installed_sources()
    found = [
        imp for file, path in sources.items() for imp in imports_in(path.read_text(), file, sources)
    ]
    return found, list(sources)


# ---------------------------------------------------------------- the package


def test_every_package_installed_is_read() -> None:
    """Each package ``pyproject.toml`` installs has its ``__init__.py`` among the files read."""
    files = installed_sources()
    for package in setuptools_config()["packages"]:
        assert f"{package.replace('.', '/')}/__init__.py" in files, package
    assert files["rdmashim/ulps/rds/node.py"] == REPO / "ulps/rds/node.py"
    assert files["rdmashim/providers/ibal/ca.py"] == REPO / "providers/ibal/ca.py"


def test_every_module_is_in_one_layer_and_every_import_runs_along_an_arrow() -> None:
    found, files = _package_imports()
    assert len(found) > 500, "the checker reads too few imports to be reading the package"
    broken = refusals(found, files)
    assert not broken, "the layers are broken:\n" + "\n".join(broken)


def test_the_engine_modules_import_one_another_in_no_loop() -> None:
    """The built-in engine's modules stand one above another (the native engine's issue):
    no two import each other, not even for annotations; where one names a type of a
    module above it, it says what it asks of it with a protocol of its own (a CQ of its
    QPs and context, a QP of its PD and context)."""
    found, files = _package_imports()
    assert not loops(found, files, "rdmashim/providers/softiwarp/")


def test_only_the_registry_imports_by_name() -> None:
    """``importlib`` and ``__import__`` load what no ``import`` names, past the checker:
    only the registry does so, to load the backend a caller chose, and the facade's
    ``moved``, to give an old backend name the module of its new one (test_moved)."""
    callers = sorted(
        file
        for file, path in installed_sources().items()
        for node in ast.walk(ast.parse(path.read_text(), file))
        if isinstance(node, ast.Attribute | ast.Name)
        and (node.attr if isinstance(node, ast.Attribute) else node.id)
        in ("import_module", "__import__")
    )
    assert set(callers) == {"rdmashim/verbs/backend.py", "rdmashim/moved.py"}, callers


def test_the_registry_loads_the_backend_layers_and_nothing_else() -> None:
    """What the registry imports by name is one backend layer each, and every backend
    layer is registered: the one import the checker cannot read stays a backend's."""
    files = installed_sources()
    registered = []
    for info in BACKENDS.values():
        package = module_file(info.module, files)
        assert package == f"{info.module.replace('.', '/')}/__init__.py", info
        registered += layers_of(package)
    assert sorted(registered) == sorted(_BACKENDS)


def test_the_tables_name_real_layers() -> None:
    named = {layer for pair in (*ARROWS, *NEVER) for layer in pair}
    assert named <= set(LAYERS)
    assert not ARROWS & set(NEVER), "an arrow both allowed and refused"


# ---------------------------------------------------------------- the checker sees


FILES = [
    "rdmashim/__init__.py",
    "rdmashim/registry.py",
    "rdmashim/cli.py",
    "rdmashim/verbs/__init__.py",
    "rdmashim/verbs/abc.py",
    "rdmashim/verbs/backend.py",
    "rdmashim/cm/__init__.py",
    "rdmashim/cm/abc.py",
    "rdmashim/cm/channel.py",
    "rdmashim/providers/softiwarp/__init__.py",
    "rdmashim/providers/softiwarp/engine.py",
    "rdmashim/providers/rdmacore/__init__.py",
    "rdmashim/providers/ibal/__init__.py",
    "rdmashim/providers/ibal/ca.py",
    "rdmashim/ulps/__init__.py",
    "rdmashim/ulps/rds/__init__.py",
    "rdmashim/ulps/rds/node.py",
]


def test_the_checker_reads_imports_wherever_they_stand() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import rdmashim.verbs.abc\n"
        "from rdmashim.verbs import backend, Access\n"
        "from . import abc\n"
        "if TYPE_CHECKING:\n"
        "    from rdmashim.cm.abc import Connector\n"
        "def lazy():\n"
        "    from ..softiwarp import engine\n"
    )
    found = list(imports_in(source, "rdmashim/providers/ibal/ca.py", FILES))
    assert [(i.line, i.target) for i in found] == [
        (2, "rdmashim.verbs.abc"),
        (3, "rdmashim.verbs.backend"),
        (3, "rdmashim.verbs"),
        (4, "rdmashim.providers.ibal"),
        (6, "rdmashim.cm.abc"),
        (8, "rdmashim.providers.softiwarp.engine"),
    ]
    assert module_file("rdmashim.providers.softiwarp._accel", FILES) == (
        "rdmashim/providers/softiwarp/__init__.py"
    )


def test_the_checker_names_file_import_and_rule() -> None:
    found = [
        Import("rdmashim/verbs/backend.py", 3, "rdmashim.cm.abc"),
        Import("rdmashim/cm/channel.py", 5, "rdmashim.registry"),
        Import("rdmashim/providers/ibal/ca.py", 7, "rdmashim.providers.softiwarp.engine"),
        Import("rdmashim/ulps/rds/node.py", 9, "rdmashim.providers.rdmacore"),
        Import("rdmashim/providers/softiwarp/engine.py", 11, "rdmashim.ulps.rds.node"),
        Import("rdmashim/providers/rdmacore/__init__.py", 13, "rdmashim.cli"),
        Import("rdmashim/cli.py", 15, "rdmashim.providers.softiwarp"),
        Import("rdmashim/cm/channel.py", 17, "rdmashim.verbs.abc"),  # allowed
        Import("rdmashim/ulps/rds/node.py", 19, "trio"),  # not of the package
    ]
    assert refusals(found, FILES) == [
        "rdmashim/verbs/backend.py:3 imports rdmashim.cm.abc (Verbs -> CM): "
        "verbs know nothing of connection management",
        "rdmashim/cm/channel.py:5 imports rdmashim.registry (CM -> Facade): no reaching up",
        "rdmashim/providers/ibal/ca.py:7 imports rdmashim.providers.softiwarp.engine "
        "(Ibal -> Engine): "
        "IBAL runs over any HCA through the contract",
        "rdmashim/ulps/rds/node.py:9 imports rdmashim.providers.rdmacore (RDS -> RdmaCore): "
        "ULPs use only the portable API",
        "rdmashim/providers/softiwarp/engine.py:11 imports rdmashim.ulps.rds.node (Engine -> RDS): "
        "lower layers know no ULP",
        "rdmashim/providers/rdmacore/__init__.py:13 imports rdmashim.cli (RdmaCore -> Tools): "
        "no reaching up",
        "rdmashim/cli.py:15 imports rdmashim.providers.softiwarp (Tools -> Engine): "
        "Tools may import only CM, Facade, NFS, RDS, Verbs",
    ]


def test_the_loop_finder_finds_a_loop_through_others_and_only_it() -> None:
    files = [f"rdmashim/providers/softiwarp/{name}.py" for name in ("a", "b", "c", "d")]
    files.append("rdmashim/providers/softiwarp/__init__.py")
    found = [
        Import(files[0], 1, "rdmashim.providers.softiwarp.b"),
        Import(files[1], 1, "rdmashim.providers.softiwarp.c"),
        Import(files[2], 1, "rdmashim.providers.softiwarp.a"),  # a -> b -> c -> a
        Import(files[3], 1, "rdmashim.providers.softiwarp.a"),  # d above the loop
        Import(files[0], 2, "rdmashim.providers.softiwarp"),  # the face: not a loop
        Import(files[4], 1, "rdmashim.providers.softiwarp.a"),
    ]
    assert loops(found, files, "rdmashim/providers/softiwarp/") == [files[:3]]
    assert loops(found[3:], files, "rdmashim/providers/softiwarp/") == []


def test_a_module_in_no_layer_or_in_two_is_refused() -> None:
    assert refusals([], [*FILES, "rdmashim/newthing.py"]) == [
        "rdmashim/newthing.py is in 0 layers []: put it in exactly one of LAYERS"
    ]
    assert layers_of("rdmashim/providers/softiwarp/engine.py") == ["Engine"]
    assert layers_of("rdmashim/ulps/__init__.py") == ["ULPs"]
