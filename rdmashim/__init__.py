"""rdmashim: a portable RDMA SDK for Python.

One verbs + rdma_cm API over three backends; the default is the built-in
soft-iWARP engine, which needs nothing but TCP::

    import trio, rdmashim

    async def main():
        async with rdmashim.open_device() as ctx:     # siw_lo by default
            pd = ctx.alloc_pd()
            mr = pd.reg_mr(bytearray(4096), rdmashim.Access.LOCAL_WRITE)
            ...

    trio.run(main)
"""

from collections.abc import AsyncIterator as _AsyncIterator
from contextlib import asynccontextmanager as _asynccontextmanager

from rdmashim import moved as _moved
from rdmashim.registry import chosen_backend
from rdmashim.registry import load_backend as _load_backend
from rdmashim.verbs import *  # noqa: F403
from rdmashim.verbs import __all__ as _verbs_all
from rdmashim.verbs.abc import Context as _Context
from rdmashim.verbs.abc import Device as _Device

__version__ = "0.1.0"

_moved.install()  # the backends' old names (rdmashim.verbs.softiwarp, ...) still import


def get_device_list(*, backend: str | None = None) -> list[_Device]:
    """Devices of the chosen backend (``RDMASHIM_BACKEND``, default softiwarp)."""
    return _load_backend(backend).get_device_list()


@_asynccontextmanager
async def open_device(
    name: str | None = None, *, backend: str | None = None
) -> _AsyncIterator[_Context]:
    """Open a device of the chosen backend as an async context manager.

    The context satisfies :class:`rdmashim.verbs.abc.Context` on every backend.
    """
    async with _load_backend(backend).open_device(name) as ctx:
        yield ctx


__all__ = ["__version__", "chosen_backend", "get_device_list", "open_device", *_verbs_all]
del _verbs_all
