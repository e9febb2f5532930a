"""The backends' old import names (``rdmashim.verbs.softiwarp`` ...) still import, with
a DeprecationWarning naming the new one, and give the very module of the new name."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from rdmashim import moved


def test_an_old_name_gives_the_new_module_with_a_warning() -> None:
    """(In a fresh interpreter: this one may have imported the name already.)"""
    code = (
        "import warnings, importlib\n"
        "warnings.simplefilter('error')\n"
        "try:\n"
        "    import rdmashim.verbs.softiwarp.connection\n"
        "except DeprecationWarning as w:\n"
        "    print('warned:', w)\n"
        "warnings.simplefilter('ignore')\n"
        "import rdmashim.verbs.softiwarp.connection as old\n"
        "from rdmashim.verbs.rdmacore import backend as old_rc\n"
        "import rdmashim.providers.softiwarp.connection as new\n"
        "import rdmashim.providers.rdmacore.backend as new_rc\n"
        "print(old is new, old_rc is new_rc, old.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert lines[0] == (
        "warned: rdmashim.verbs.softiwarp is now rdmashim.providers.softiwarp "
        "(the backends moved out of rdmashim.verbs)"
    )
    assert lines[1] == "True True rdmashim.providers.softiwarp.connection"


def test_only_the_moved_packages_have_old_names() -> None:
    assert moved.new_name("rdmashim.verbs.ibal.ca") == "rdmashim.providers.ibal.ca"
    assert moved.new_name("rdmashim.verbs.rdmacore") == "rdmashim.providers.rdmacore"
    assert moved.new_name("rdmashim.verbs.wr") is None
    assert moved.new_name("rdmashim.verbs.softiwarpx") is None
    assert moved.new_name("rdmashim.cm.softiwarp") is None
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("rdmashim.verbs.no_such_backend")
