"""Decoding ``struct ibv_wc`` into :class:`WC` (no device needed: the struct is made here)."""

from __future__ import annotations

from rdmashim import WCArray, WCFlags, WCOpcode, WCStatus
from rdmashim.providers.rdmacore.cdefs import ffi
from rdmashim.providers.rdmacore.completion import WCBuffer, decode_into, decode_wc


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


def test_an_array_decodes_as_each_entry_does() -> None:
    """``poll_into``'s column-wise decoding of a ``struct ibv_wc[]`` equals ``decode_wc``."""
    raw_imm = int.from_bytes(bytes.fromhex("01020304"), "little")
    entries = [
        {"wr_id": 1 << 63, "opcode": int(WCOpcode.RECV), "byte_len": 64, "qp_num": 5},
        {"wr_id": 2, "status": int(WCStatus.WR_FLUSH_ERR), "opcode": 0xFF, "vendor_err": 9},
        {"wr_id": 3, "opcode": int(WCOpcode.RECV), "imm_data": raw_imm,
         "wc_flags": int(WCFlags.WITH_IMM)},
        {"wr_id": 4, "opcode": int(WCOpcode.RECV), "invalidated_rkey": 0xABCD,
         "wc_flags": int(WCFlags.WITH_INV | WCFlags.GRH)},
        {"wr_id": 5, "status": 999, "opcode": int(WCOpcode.RDMA_READ), "byte_len": 7},
    ]  # fmt: skip
    buf = WCBuffer(8)
    for i, fields in enumerate(entries):
        for name, value in fields.items():
            setattr(buf.c[i], name, value)
    wcs = WCArray(9)
    decode_into(wcs, buf, 2, len(entries))
    expected = [decode_wc(buf.c[i]) for i in range(len(entries))]
    assert [wcs[2 + i] for i in range(len(entries))] == expected
    assert wcs[3].status is WCStatus.WR_FLUSH_ERR and wcs[4].imm_data == 0x01020304
    assert wcs[0] == WCArray(1)[0]  # entries before ``start`` untouched
    # All successful, no flags: the fast columns.
    decode_into(wcs, buf, 0, 1)
    assert wcs[0] == expected[0] and wcs.opcode[0] is WCOpcode.RECV
