"""Decoding ``struct ibv_wc`` into :class:`WC` (no device needed: the struct is made here)."""

from __future__ import annotations

from rdmashim import WCFlags, WCOpcode, WCStatus
from rdmashim.verbs.rdmacore.cdefs import ffi
from rdmashim.verbs.rdmacore.completion import decode_wc


def _wc(**fields: int) -> object:
    wc = ffi.new("struct ibv_wc *")
    for name, value in fields.items():
        setattr(wc, name, value)
    return wc[0]


def test_immediate_data_is_converted_from_network_order() -> None:
    # libibverbs leaves imm_data as the wire's big-endian bytes: 12 34 56 78.
    raw = int.from_bytes(bytes.fromhex("12345678"), "little")
    wc = decode_wc(
        _wc(wr_id=7, status=0, opcode=int(WCOpcode.RECV), imm_data=raw,
            wc_flags=int(WCFlags.WITH_IMM), byte_len=3, qp_num=9)
    )  # fmt: skip
    assert (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.qp_num) == (
        7, WCStatus.SUCCESS, WCOpcode.RECV, 3, 9,
    )  # fmt: skip
    assert wc.wc_flags & WCFlags.WITH_IMM
    assert wc.imm_data == 0x12345678
    assert wc.invalidated_rkey == 0


def test_no_immediate_data_without_the_flag() -> None:
    wc = decode_wc(_wc(opcode=int(WCOpcode.RECV), imm_data=0xDEADBEEF))
    assert wc.imm_data == 0 and not wc.wc_flags & WCFlags.WITH_IMM


def test_invalidated_rkey_shares_the_union_in_host_order() -> None:
    wc = decode_wc(
        _wc(opcode=int(WCOpcode.RECV), invalidated_rkey=0xABCD, wc_flags=int(WCFlags.WITH_INV))
    )
    assert wc.invalidated_rkey == 0xABCD and wc.imm_data == 0


def test_unknown_status_and_error_opcode() -> None:
    wc = decode_wc(_wc(status=999, opcode=0x80 | 0x7F))
    assert wc.status == WCStatus.GENERAL_ERR and wc.opcode == WCOpcode.RECV
