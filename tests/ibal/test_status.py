"""Status codes: WinOF's values and names, the errno maps, and how calls report them."""

from __future__ import annotations

import errno

import pytest

from rdmashim.providers.ibal import (
    IbError,
    IbStatus,
    errno_from_status,
    ib_get_err_str,
    ib_wc_status_t,
    status_from_errno,
)
from rdmashim.providers.ibal.cq import ib_wc_t
from rdmashim.verbs.enums import WCFlags, WCOpcode, WCStatus
from rdmashim.verbs.wr import WC


def test_values_are_winofs() -> None:
    assert (IbStatus.IB_SUCCESS, IbStatus.IB_NOT_FOUND, IbStatus.IB_INVALID_QP_STATE) == (0, 5, 13)
    assert (IbStatus.IB_INVALID_CQ_HANDLE, IbStatus.IB_INVALID_QP_HANDLE) == (32, 33)
    assert IbStatus.IB_UNKNOWN_ERROR == max(IbStatus) == 54
    assert ib_wc_status_t.IB_WCS_WR_FLUSHED_ERR == 4 and ib_wc_status_t.IB_WCS_UNKNOWN == 17


def test_error_strings() -> None:
    assert ib_get_err_str(IbStatus.IB_INVALID_SETTING) == "IB_INVALID_SETTING"
    assert ib_get_err_str(999) == "IB_UNKNOWN_ERROR"


@pytest.mark.parametrize(
    ("err", "status"),
    [
        (errno.ENOMEM, IbStatus.IB_INSUFFICIENT_MEMORY),
        (errno.EINVAL, IbStatus.IB_INVALID_PARAMETER),
        (errno.EOPNOTSUPP, IbStatus.IB_UNSUPPORTED),
        (errno.EACCES, IbStatus.IB_INVALID_PERMISSION),
        (errno.EBUSY, IbStatus.IB_RESOURCE_BUSY),
        (errno.EOVERFLOW, IbStatus.IB_OVERFLOW),
        (errno.EXDEV, IbStatus.IB_ERROR),
        (None, IbStatus.IB_ERROR),
    ],
)
def test_errno_to_status(err: int | None, status: IbStatus) -> None:
    assert status_from_errno(err) is status


def test_status_to_errno_and_the_error() -> None:
    assert errno_from_status(IbStatus.IB_INVALID_QP_STATE) == errno.EINVAL
    assert errno_from_status(IbStatus.IB_INVALID_CA_HANDLE) == errno.EIO
    exc = IbError(IbStatus.IB_TIMEOUT, "ib_cm_req", "no answer")
    assert isinstance(exc, OSError) and exc.errno == errno.ETIMEDOUT
    assert str(exc) == "ib_cm_req: IB_TIMEOUT (no answer)" and exc.failed_wr is None


def test_a_completion_converts_status_type_and_options() -> None:
    entry = ib_wc_t()
    imm = WC(5, WCStatus.SUCCESS, WCOpcode.RECV_RDMA_WITH_IMM, 0, 1, WCFlags.WITH_IMM, imm_data=7)
    entry.fill(imm)
    assert (entry.wr_id, entry.wc_type.name, entry.recv.conn.immediate_data) == (
        5,
        "IB_WC_RECV_RDMA_WRITE",
        7,
    )
    assert entry.recv.conn.recv_opt.name == "IB_RECV_OPT_IMMEDIATE"
    for portable, ibal in [
        (WCStatus.WR_FLUSH_ERR, ib_wc_status_t.IB_WCS_WR_FLUSHED_ERR),
        (WCStatus.REM_ACCESS_ERR, ib_wc_status_t.IB_WCS_REM_ACCESS_ERR),
        (WCStatus.RETRY_EXC_ERR, ib_wc_status_t.IB_WCS_TIMEOUT_RETRY_ERR),
        (WCStatus.FATAL_ERR, ib_wc_status_t.IB_WCS_GENERAL_ERR),
    ]:
        entry.fill(WC(1, portable, WCOpcode.SEND))
        assert entry.status is ibal and entry.recv.conn.recv_opt == 0
