"""``ib_api_status_t``: IBAL's status codes, their names, and their errno counterparts.

Every IBAL call returns a status. The facade keeps the codes (``IbStatus``, in
``ib_types.h`` order, so the values are WinOF's) and spells the failure of a
call as an :class:`IbError` carrying its status; the portable backend turns a
status into an errno (:func:`errno_from_status`) and a verbs error into a
status (:func:`status_from_errno`).
"""

from __future__ import annotations

import errno
from enum import IntEnum
from typing import Any


class IbStatus(IntEnum):
    """``ib_api_status_t``, value for value."""

    IB_SUCCESS = 0
    IB_INSUFFICIENT_RESOURCES = 1
    IB_INSUFFICIENT_MEMORY = 2
    IB_INVALID_PARAMETER = 3
    IB_INVALID_SETTING = 4
    IB_NOT_FOUND = 5
    IB_TIMEOUT = 6
    IB_CANCELED = 7
    IB_INTERRUPTED = 8
    IB_INVALID_PERMISSION = 9
    IB_UNSUPPORTED = 10
    IB_OVERFLOW = 11
    IB_MAX_MCAST_QPS_REACHED = 12
    IB_INVALID_QP_STATE = 13
    IB_INVALID_APM_STATE = 14
    IB_INVALID_PORT_STATE = 15
    IB_INVALID_STATE = 16
    IB_RESOURCE_BUSY = 17
    IB_INVALID_PKEY = 18
    IB_INVALID_LKEY = 19
    IB_INVALID_RKEY = 20
    IB_INVALID_MAX_WRS = 21
    IB_INVALID_MAX_SGE = 22
    IB_INVALID_CQ_SIZE = 23
    IB_INVALID_SRQ_SIZE = 24
    IB_INVALID_SERVICE_TYPE = 25
    IB_INVALID_GID = 26
    IB_INVALID_LID = 27
    IB_INVALID_GUID = 28
    IB_INVALID_GUID_MASK = 29
    IB_INVALID_CA_HANDLE = 30
    IB_INVALID_AV_HANDLE = 31
    IB_INVALID_CQ_HANDLE = 32
    IB_INVALID_QP_HANDLE = 33
    IB_INVALID_SRQ_HANDLE = 34
    IB_INVALID_PD_HANDLE = 35
    IB_INVALID_MR_HANDLE = 36
    IB_INVALID_FMR_HANDLE = 37
    IB_INVALID_MW_HANDLE = 38
    IB_INVALID_MCAST_HANDLE = 39
    IB_INVALID_CALLBACK = 40
    IB_INVALID_AL_HANDLE = 41
    IB_INVALID_HANDLE = 42
    IB_ERROR = 43
    IB_REMOTE_ERROR = 44
    IB_VERBS_PROCESSING_DONE = 45
    IB_INVALID_WR_TYPE = 46
    IB_QP_IN_TIMEWAIT = 47
    IB_EE_IN_TIMEWAIT = 48
    IB_INVALID_PORT = 49
    IB_NOT_DONE = 50
    IB_INVALID_INDEX = 51
    IB_NO_MATCH = 52
    IB_PENDING = 53
    IB_UNKNOWN_ERROR = 54


def ib_get_err_str(status: int) -> str:
    """The status's name, as IBAL's ``ib_get_err_str`` spells it (IB_UNKNOWN_ERROR if none)."""
    try:
        return IbStatus(status).name
    except ValueError:
        return IbStatus.IB_UNKNOWN_ERROR.name


_TO_ERRNO: dict[IbStatus, int] = {
    IbStatus.IB_SUCCESS: 0,
    IbStatus.IB_INSUFFICIENT_RESOURCES: errno.ENOBUFS,
    IbStatus.IB_INSUFFICIENT_MEMORY: errno.ENOMEM,
    IbStatus.IB_INVALID_PARAMETER: errno.EINVAL,
    IbStatus.IB_INVALID_SETTING: errno.EINVAL,
    IbStatus.IB_NOT_FOUND: errno.ENOENT,
    IbStatus.IB_TIMEOUT: errno.ETIMEDOUT,
    IbStatus.IB_CANCELED: errno.ECANCELED,
    IbStatus.IB_INTERRUPTED: errno.EINTR,
    IbStatus.IB_INVALID_PERMISSION: errno.EACCES,
    IbStatus.IB_UNSUPPORTED: errno.EOPNOTSUPP,
    IbStatus.IB_OVERFLOW: errno.EOVERFLOW,
    IbStatus.IB_INVALID_QP_STATE: errno.EINVAL,
    IbStatus.IB_INVALID_PORT_STATE: errno.ENETDOWN,
    IbStatus.IB_INVALID_STATE: errno.EINVAL,
    IbStatus.IB_RESOURCE_BUSY: errno.EBUSY,
    IbStatus.IB_INVALID_LKEY: errno.EINVAL,
    IbStatus.IB_INVALID_RKEY: errno.EINVAL,
    IbStatus.IB_INVALID_MAX_WRS: errno.EINVAL,
    IbStatus.IB_INVALID_MAX_SGE: errno.EINVAL,
    IbStatus.IB_INVALID_CQ_SIZE: errno.EINVAL,
    IbStatus.IB_INVALID_SRQ_SIZE: errno.EINVAL,
    IbStatus.IB_INVALID_SERVICE_TYPE: errno.EOPNOTSUPP,
    IbStatus.IB_INVALID_GUID: errno.ENODEV,
    IbStatus.IB_INVALID_CALLBACK: errno.EINVAL,
    IbStatus.IB_REMOTE_ERROR: errno.EREMOTEIO,
    IbStatus.IB_INVALID_WR_TYPE: errno.EINVAL,
    IbStatus.IB_QP_IN_TIMEWAIT: errno.EBUSY,
    IbStatus.IB_INVALID_PORT: errno.EINVAL,
    IbStatus.IB_NOT_DONE: errno.EAGAIN,
    IbStatus.IB_INVALID_INDEX: errno.EINVAL,
    IbStatus.IB_NO_MATCH: errno.ESRCH,
    IbStatus.IB_PENDING: errno.EINPROGRESS,
}

_FROM_ERRNO: dict[int, IbStatus] = {
    errno.ENOMEM: IbStatus.IB_INSUFFICIENT_MEMORY,
    errno.ENOBUFS: IbStatus.IB_INSUFFICIENT_RESOURCES,
    errno.EAGAIN: IbStatus.IB_INSUFFICIENT_RESOURCES,
    errno.ENOSPC: IbStatus.IB_INSUFFICIENT_RESOURCES,
    errno.EINVAL: IbStatus.IB_INVALID_PARAMETER,
    errno.ENOENT: IbStatus.IB_NOT_FOUND,
    errno.ENODEV: IbStatus.IB_NOT_FOUND,
    errno.ETIMEDOUT: IbStatus.IB_TIMEOUT,
    errno.ECANCELED: IbStatus.IB_CANCELED,
    errno.EINTR: IbStatus.IB_INTERRUPTED,
    errno.EACCES: IbStatus.IB_INVALID_PERMISSION,
    errno.EPERM: IbStatus.IB_INVALID_PERMISSION,
    errno.EOPNOTSUPP: IbStatus.IB_UNSUPPORTED,
    errno.ENOSYS: IbStatus.IB_UNSUPPORTED,
    errno.EOVERFLOW: IbStatus.IB_OVERFLOW,
    errno.EBUSY: IbStatus.IB_RESOURCE_BUSY,
    errno.EADDRINUSE: IbStatus.IB_RESOURCE_BUSY,
    errno.ENETDOWN: IbStatus.IB_INVALID_PORT_STATE,
    errno.EREMOTEIO: IbStatus.IB_REMOTE_ERROR,
    errno.ECONNREFUSED: IbStatus.IB_REMOTE_ERROR,
    errno.ECONNRESET: IbStatus.IB_REMOTE_ERROR,
    errno.ESRCH: IbStatus.IB_NO_MATCH,
    errno.EINPROGRESS: IbStatus.IB_PENDING,
}


def errno_from_status(status: IbStatus) -> int:
    """The errno a POSIX-shaped API reports for ``status`` (EIO for the rest)."""
    return _TO_ERRNO.get(status, errno.EIO)


def status_from_errno(err: int | None) -> IbStatus:
    """The status an IBAL call returns where the HCA reported ``err`` (IB_ERROR for the rest)."""
    if err is None:
        return IbStatus.IB_ERROR
    return _FROM_ERRNO.get(err, IbStatus.IB_ERROR)


class IbError(OSError):
    """An IBAL call did not return IB_SUCCESS.

    ``status`` is the :class:`IbStatus`, ``call`` the function (``ib_create_qp``);
    ``errno`` is the status's POSIX counterpart, so code that catches ``OSError``
    sees a sensible number.
    """

    failed_wr: Any = None
    """For a post call: the work request of the chain that was refused (those before
    it are posted), as IBAL's failure pointer."""

    def __init__(self, status: IbStatus, call: str, detail: str = "") -> None:
        self.status = IbStatus(status)
        self.call = call
        self.detail = detail
        message = f"{call}: {ib_get_err_str(status)}"
        if detail:
            message += f" ({detail})"
        super().__init__(errno_from_status(self.status), message)

    def __str__(self) -> str:
        return str(self.strerror)
