"""The rdma-core backend: Linux's libibverbs and librdmacm through cffi in ABI mode.

Needs no compiler and no headers: the libraries are opened with ``dlopen``
the first time a device is listed or opened (:mod:`.lib`). cffi itself is the
``rdmacore`` extra (``pip install 'rdmashim[rdmacore]'``); importing this package
without it raises :class:`~rdmashim.verbs.errors.BackendUnavailable` saying so,
which ``rdmashim devices`` reports as the backend's reason. Choosing the
backend where the libraries, or an RDMA device, are missing raises
:class:`~rdmashim.verbs.errors.BackendUnavailable` saying what to install or
why no device is usable. Layers: the C declarations (:mod:`.cdefs`), loading
(:mod:`.lib`), object lifetime (:mod:`.base`), and the verbs objects
(:mod:`.provider`), librdmacm's CM ids (:mod:`.cm_id`) and the backend object
the registry hands out (:mod:`.backend`, ``BACKEND``).
"""

from rdmashim.verbs.errors import BackendUnavailable

try:
    import cffi  # noqa: F401  (the base install leaves it out; every module here needs it)
except ImportError as exc:
    raise BackendUnavailable(
        f"the rdmacore backend needs cffi ({exc}): pip install 'rdmashim[rdmacore]'"
    ) from exc

from rdmashim.providers.rdmacore.backend import BACKEND
from rdmashim.providers.rdmacore.provider import (
    Device,
    get_device_list,
    open_device,
    unavailable_reason,
)

__all__ = ["BACKEND", "Device", "get_device_list", "open_device", "unavailable_reason"]
