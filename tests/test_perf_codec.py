"""perftest's exchange messages and result table, byte and text exact.

The reference bytes are the payloads of the Sends in ``tests/captures/siw-write_bw.pcap``
(perftest 4.5-0.17, which calls itself 6.06, talking to itself over the kernel's siw).
"""

from __future__ import annotations

import pytest

from rdmashim.perftools import report, wire

# Send payloads of the capture (after the 18-byte DDP/RDMAP header).
VERSION_6_06 = bytes.fromhex("362e3036000000000000000000000000")
PAGE = bytes.fromhex("00001000")
LINE = bytes.fromhex("00000040")
MTU_1024 = bytes.fromhex("3300")
CLIENT_DEST = bytes.fromhex(
    "00000000"
    "00000001"
    "00000003"
    "001fb687"
    "b419c900"
    "00000000"
    "00005594a275e000"
    "525400f6b06e00000000000000000000"
    "00000000"
    "00000000"
)
REPORT = [bytes.fromhex(h) for h in (
    "0000000000001000", "0000000000000028", "400c0715cc751a22", "4007f3df70b68fbf",
    "3f491dbc1329d3cb",
)]  # fmt: skip


def test_version() -> None:
    assert wire.encode_version("6.06", tagged=False) == VERSION_6_06
    assert wire.decode_version(VERSION_6_06) == "6.06"
    assert wire.version_number("6.06") == pytest.approx(6.06)
    assert wire.version_number("5.70-beta") == pytest.approx(5.70)
    assert wire.version_number("") == 0.0
    with pytest.raises(wire.WireError):
        wire.decode_version(VERSION_6_06[:8])


def test_version_with_our_tag() -> None:
    """Ours puts a tag, a raw TCP port and the --vs-tcp wish after the version's NUL:
    what perftest reads (up to the NUL) is unchanged, and perftest's own message
    carries nothing there."""
    ours = wire.encode_version("6.06", tcp_port=40000)
    assert len(ours) == wire.VERSION_SIZE and ours[:5] == VERSION_6_06[:5]
    assert ours[5:] == b"rdmashim\x9c\x40\x00"
    assert wire.decode_version(ours) == "6.06"
    assert wire.decode_peer(ours) == wire.Peer(True, 40000, False)
    assert wire.decode_peer(wire.encode_version(wants_tcp=True)) == wire.Peer(True, None, True)
    assert wire.decode_peer(VERSION_6_06) == wire.Peer(rdmashim=False)
    assert wire.decode_peer(b"6.06\0rdmash" + bytes(5)) == wire.Peer(rdmashim=False)
    with pytest.raises(ValueError):
        wire.encode_version("6.06-long")


def test_ints_and_mtu() -> None:
    assert wire.encode_int(4096) == PAGE and wire.decode_int(PAGE) == 4096
    assert wire.encode_int(64) == LINE and wire.decode_int(LINE) == 64
    assert wire.encode_mtu(3) == MTU_1024 and wire.decode_mtu(MTU_1024) == 3
    assert wire.decode_mtu(b"9\0") == 0  # not an ibv_mtu: perftest keeps its own
    with pytest.raises(ValueError):
        wire.encode_mtu(6)
    with pytest.raises(wire.WireError):
        wire.decode_int(b"\0\0")


def test_dest_from_capture() -> None:
    dest = wire.Dest.decode(CLIENT_DEST)
    assert dest == wire.Dest(
        lid=0, out_reads=1, qpn=3, psn=0x1FB687, rkey=0xB419C900, vaddr=0x5594A275E000,
        gid=bytes.fromhex("525400f6b06e") + bytes(10), srqn=0, gid_index=0,
    )  # fmt: skip
    assert dest.encode() == CLIENT_DEST
    assert len(wire.Dest().encode()) == wire.Dest.SIZE == 56
    padded = bytearray(CLIENT_DEST)
    padded[20:24] = b"\x00\x94\x55\x00"  # perftest leaves stack bytes in the padding
    assert wire.Dest.decode(bytes(padded)) == dest
    with pytest.raises(wire.WireError):
        wire.Dest.decode(CLIENT_DEST[:-1])


def test_bw_report_from_capture() -> None:
    rep = wire.BwReport.decode(REPORT)
    assert (rep.size, rep.iters) == (4096, 40)
    assert rep.bw_peak == pytest.approx(3.5035, abs=1e-3)
    assert rep.encode() == REPORT
    with pytest.raises(wire.WireError):
        wire.BwReport.decode(REPORT[:4])


def test_credit_is_little_endian() -> None:
    assert wire.CREDIT.pack(170) == b"\xaa\0\0\0"


def test_bw_table_text() -> None:
    assert report.bw_header() == [
        report.RULE,
        " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]",
    ]
    assert report.bw_header(gbits=True, cpu_util=True)[1].endswith(
        "BW average[Gb/sec]   MsgRate[Mpps]    CPU_Util[%]"
    )
    row = report.BwResult(65536, 5000, 2484.3412, 2284.4, 0.03655)
    assert report.bw_line(row) == (
        " 65536      5000             2484.34            2284.40            0.036550"
    )
    small = report.BwResult(2, 1000, 0.05, 0.04, 2.5, cpu_util=12.5)
    assert report.bw_line(small, gbits=True) == (
        " 2          1000             0.050000            0.040000            2.500000      12.50"
    )


def test_vs_tcp_table_text() -> None:
    head = report.vs_tcp_header()
    assert head[-1].split() == [
        "#bytes", "BW", "average[MB/sec]", "TCP", "BW", "average[MB/sec]", "ours/TCP",
        "MsgRate[Mpps]", "TCP", "MsgRate[Mpps]",
    ]  # fmt: skip
    ours = report.BwResult(65536, 5000, 0.0, 2284.4, 0.03655)
    tcp = report.BwResult(65536, 5000, 0.0, 3000.0, 0.048)
    assert report.vs_tcp_line(ours, tcp) == (
        " 65536      2284.40              3000.00                  0.761      0.036550"
        "        0.048000"
    )
    assert report.vs_tcp_line(ours, report.BwResult(65536, 0, 0.0, 0.0, 0.0)).split()[3] == "inf"


def test_lat_table_text() -> None:
    line = report.LatResult(2, 1000, 1.5, 9.25, 2.0, 2.5, 0.5, 8.0, 9.25)
    assert report.lat_line(line) == (
        " 2       1000        1.50           9.25         2.00             2.50           "
        "0.50             8.00                   9.25   "
    )
    dur = report.LatDurationResult(2, 400, 12.5, 40000.0)
    assert report.lat_line(dur) == " 2             400               12.50          40000.00"
    assert "t_typical[usec]" in report.lat_header()[1]
    assert report.lat_header(duration=True)[1].split() == [
        "#bytes", "#iterations", "t_avg[usec]", "tps", "average",
    ]  # fmt: skip


def test_address_lines() -> None:
    line = report.address_line("local", 0, 3, 0x1FB687, rkey=0xB419C900, vaddr=0x5594A275E000)
    assert line == (
        " local address: LID 0000 QPN 0x0003 PSN 0x1fb687 RKey 0xb419c900 VAddr 0x005594a275e000"
    )
    assert report.address_line("remote", 0, 4, 5, out_reads=128).endswith(" OUT 0x80")
    assert report.gid_line(bytes([82, 84, 0, 246]) + bytes(12)).startswith(" GID: 82:84:00:246:")


def test_statistics() -> None:
    posted = [0, 1000, 2000, 3000]  # ns
    completed = [(1, 2500), (3, 4000)]
    r = report.bw_result(1 << 20, posted, completed)
    assert r.iters == 4
    assert r.bw_avg == pytest.approx(4 / 4e-6)  # 4 MiB in 4 us, in MiB/s
    assert r.msg_rate == pytest.approx(1.0)
    assert r.bw_peak >= r.bw_avg
    assert report.bw_result(8, posted, completed, peak=False).bw_peak == 0.0
    lat = report.lat_result(2, [0, 4000, 8000, 20000], round_trip=True)
    assert (lat.t_min, lat.t_max, lat.t_typical) == (2.0, 6.0, 2.0)
    assert lat.t_avg == pytest.approx(10 / 3)
    assert report.lat_result(2, [0, 3000], round_trip=False).t_avg == 3.0
    dur = report.lat_duration_result(2, 100, 0.01, round_trip=True)
    assert dur.t_avg == pytest.approx(50.0) and dur.tps == pytest.approx(10000.0)
