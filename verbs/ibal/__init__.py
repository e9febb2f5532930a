"""An IBAL-shaped API (WinOF's InfiniBand Access Layer) over any portable HCA.

The calls keep IBAL's names, order of arguments and status codes
(:class:`IbStatus`); handles are objects, out-parameters are return values,
and a status other than IB_SUCCESS is raised as :class:`IbError` (calls for
which another status is an ordinary answer, such as ``ib_poll_cq``'s
IB_NOT_FOUND, return it). ``docs/ibal.md`` maps the facade call by call.
"""

from rdmashim.verbs.ibal.al import IbAl, ib_close_al, ib_open_al, ib_sync_destroy
from rdmashim.verbs.ibal.status import (
    IbError,
    IbStatus,
    errno_from_status,
    ib_get_err_str,
    status_from_errno,
)

__all__ = [
    "IbAl",
    "IbError",
    "IbStatus",
    "errno_from_status",
    "ib_close_al",
    "ib_get_err_str",
    "ib_open_al",
    "ib_sync_destroy",
    "status_from_errno",
]
