"""Attribute records: device and port limits, queue pair capabilities and attributes."""

from __future__ import annotations

from dataclasses import dataclass

from rdmashim.verbs.enums import AtomicCap, Mtu, NodeType, PortState, QPState, QPType, Transport


@dataclass(frozen=True, slots=True)
class DeviceAttr:
    """What a device can do (``ibv_device_attr`` plus the transport's CM limits)."""

    fw_ver: str
    node_guid: int
    vendor_id: int
    vendor_part_id: int
    hw_ver: int
    phys_port_cnt: int
    max_mr_size: int
    page_size_cap: int
    max_qp: int
    max_qp_wr: int
    max_sge: int
    max_sge_rd: int
    max_cq: int
    max_cqe: int
    max_mr: int
    max_pd: int
    max_qp_rd_atom: int
    max_qp_init_rd_atom: int
    max_srq: int
    max_srq_wr: int
    max_srq_sge: int
    max_inline_data: int
    atomic_cap: AtomicCap
    transport: Transport
    node_type: NodeType
    max_private_data: int
    """Bytes of private data a connect, accept or reject may carry (iWARP: 256 less MPA v2's 4)."""
    active_side_sends_first: bool
    """iWARP's rule: without peer-to-peer RTR, the passive side must not send first."""
    max_mw: int = 0
    sys_image_guid: int = 0
    device_cap_flags: int = 0
    """``enum ibv_device_cap_flags`` bits, as the device reports them."""


@dataclass(frozen=True, slots=True)
class PortAttr:
    """State and limits of a device port (``ibv_port_attr``)."""

    state: PortState
    max_mtu: Mtu
    active_mtu: Mtu
    gid_tbl_len: int
    max_msg_sz: int
    link_layer: str
    netdev: str
    lid: int = 0
    sm_lid: int = 0
    lmc: int = 0
    """LID, subnet manager LID and LID mask control: InfiniBand's; 0 on iWARP and RoCE."""
    port_cap_flags: int = 0
    """``enum ibv_port_cap_flags`` bits, as the device reports them."""


@dataclass(frozen=True, slots=True)
class QPCap:
    """Queue pair capacities (``ibv_qp_cap``)."""

    max_send_wr: int = 128
    max_recv_wr: int = 128
    max_send_sge: int = 1
    max_recv_sge: int = 1
    max_inline_data: int = 0


@dataclass(frozen=True, slots=True)
class QPAttr:
    """What :meth:`QP.query` reports (a subset of ``ibv_qp_attr``)."""

    qp_state: QPState
    qp_type: QPType
    qp_num: int
    cap: QPCap
    max_rd_atomic: int
    """ORD: RDMA Reads this side may have outstanding at the peer."""
    max_dest_rd_atomic: int
    """IRD: the peer's RDMA Reads this side serves at once."""
    sq_sig_all: bool


@dataclass(frozen=True, slots=True)
class AHAttr:
    """Where a UD datagram goes (``ibv_ah_attr`` with its ``ibv_global_route``).

    RoCE addresses by GID: ``is_global`` with ``dgid`` (16 bytes, e.g. the peer's
    ``Context.query_gid``) and ``sgid_index``, the local GID table entry to send
    from (its type, RoCE v1 or v2, picks the encapsulation). InfiniBand without
    a GRH addresses by ``dlid`` alone.
    """

    dlid: int = 0
    sl: int = 0
    port_num: int = 1
    is_global: bool = False
    dgid: bytes = bytes(16)
    sgid_index: int = 0
    hop_limit: int = 64
    flow_label: int = 0
    traffic_class: int = 0
    src_path_bits: int = 0
    static_rate: int = 0
