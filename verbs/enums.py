"""Verbs enumerations with libibverbs' names (without the ``IBV_`` prefix) and values.

The numeric values are libibverbs' own, so the rdma-core backend passes them
through unchanged and a C ULP ports line by line.
"""

from __future__ import annotations

from enum import IntEnum, IntFlag


class Access(IntFlag):
    """Memory region access rights (``ibv_access_flags``)."""

    NONE = 0
    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8
    MW_BIND = 16


class WROpcode(IntEnum):
    """Send work request opcodes (``ibv_wr_opcode``)."""

    RDMA_WRITE = 0
    RDMA_WRITE_WITH_IMM = 1
    SEND = 2
    SEND_WITH_IMM = 3
    RDMA_READ = 4
    ATOMIC_CMP_AND_SWP = 5
    ATOMIC_FETCH_AND_ADD = 6
    LOCAL_INV = 7
    BIND_MW = 8
    SEND_WITH_INV = 9


class SendFlags(IntFlag):
    """Send work request flags (``ibv_send_flags``)."""

    NONE = 0
    FENCE = 1
    SIGNALED = 2
    SOLICITED = 4
    INLINE = 8


class WCStatus(IntEnum):
    """Work completion status (``ibv_wc_status``)."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_EEC_OP_ERR = 3
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    BAD_RESP_ERR = 7
    LOC_ACCESS_ERR = 8
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    LOC_RDD_VIOL_ERR = 14
    REM_INV_RD_REQ_ERR = 15
    REM_ABORT_ERR = 16
    INV_EECN_ERR = 17
    INV_EEC_STATE_ERR = 18
    FATAL_ERR = 19
    RESP_TIMEOUT_ERR = 20
    GENERAL_ERR = 21


class WCOpcode(IntEnum):
    """Work completion opcodes (``ibv_wc_opcode``)."""

    SEND = 0
    RDMA_WRITE = 1
    RDMA_READ = 2
    COMP_SWAP = 3
    FETCH_ADD = 4
    BIND_MW = 5
    LOCAL_INV = 6
    RECV = 128
    RECV_RDMA_WITH_IMM = 129


class WCFlags(IntFlag):
    """Work completion flags (``ibv_wc_flags``)."""

    NONE = 0
    GRH = 1
    WITH_IMM = 2
    IP_CSUM_OK = 4
    WITH_INV = 8


class QPState(IntEnum):
    """Queue pair states (``ibv_qp_state``)."""

    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    SQD = 4
    SQE = 5
    ERR = 6


class QPType(IntEnum):
    """Queue pair transport types (``ibv_qp_type``)."""

    RC = 2
    UC = 3
    UD = 4


class Transport(IntEnum):
    """Transport of a device (``ibv_transport_type``)."""

    IB = 0
    IWARP = 1


class NodeType(IntEnum):
    """Node type of a device (``ibv_node_type``)."""

    CA = 1
    SWITCH = 2
    ROUTER = 3
    RNIC = 4


class PortState(IntEnum):
    """Logical port state (``ibv_port_state``)."""

    NOP = 0
    DOWN = 1
    INIT = 2
    ARMED = 3
    ACTIVE = 4


class AtomicCap(IntEnum):
    """Atomic operation support (``ibv_atomic_cap``)."""

    NONE = 0
    HCA = 1
    GLOB = 2


class Mtu(IntEnum):
    """Path MTU (``ibv_mtu``)."""

    MTU_256 = 1
    MTU_512 = 2
    MTU_1024 = 3
    MTU_2048 = 4
    MTU_4096 = 5

    @classmethod
    def fitting(cls, mtu: int) -> Mtu:
        """The largest verbs MTU not above a network MTU in bytes."""
        best = cls.MTU_256
        for m in cls:
            if 128 << m <= mtu:
                best = m
        return best
