"""``rdmashim devinfo`` reads as rdma-core's ``ibv_devinfo``: its fields, spellings and options.

The formatting is checked directly (on the attributes a real softiwarp device
reports, varied where a case needs a value softiwarp never has), and the
command as a user runs it, in a subprocess.
"""

from __future__ import annotations

import dataclasses
import re

import trio

import rdmashim
from rdmashim.devinfo import device_lines, field, guid_text, list_lines, mtu_text
from rdmashim.verbs.attrs import DeviceAttr, PortAttr
from rdmashim.verbs.enums import AtomicCap, Mtu, PortState, Transport

from clirun import assert_one_error_line
from clirun import rdmashim as run

GUID = re.compile(r"^\tnode_guid:\t\t\t(?:[0-9a-f]{4}:){3}[0-9a-f]{4}$", re.MULTILINE)
VERBOSE_ONLY = (
    "max_mr_size", "page_size_cap", "max_qp", "device_cap_flags", "max_cqe", "atomic_cap",
    "max_msg_sz", "port_cap_flags",
)  # fmt: skip


def real_attrs() -> tuple[DeviceAttr, PortAttr]:
    async def query() -> tuple[DeviceAttr, PortAttr]:
        async with rdmashim.open_device("siw_lo", backend="softiwarp") as ctx:
            return ctx.query_device(), ctx.query_port(1)

    return trio.run(query)


# ------------------------------------------------------------------ the pure formatting
def test_guid_is_four_groups_of_four_hex_digits() -> None:
    assert guid_text(0x6C6F00FFFE000000) == "6c6f:00ff:fe00:0000"
    assert guid_text(0) == "0000:0000:0000:0000"
    assert guid_text(0x0002C90300A1B2C3) == "0002:c903:00a1:b2c3"


def test_fields_are_tabbed_to_ibv_devinfos_columns() -> None:
    # (indent, name, the tabs ibv_devinfo puts between name and value)
    cases = [
        (1, "transport", 3), (1, "fw_ver", 4), (1, "node_guid", 3), (1, "hw_ver", 4),
        (1, "vendor_part_id", 3), (1, "max_qp", 4), (1, "max_qp_init_rd_atom", 2),
        (1, "device_cap_flags", 2), (1, "max_total_mcast_qp_attach", 1),
        (3, "state", 3), (3, "max_mtu", 2), (3, "sm_lid", 3), (3, "port_lmc", 2),
        (3, "port_cap_flags2", 1),
    ]  # fmt: skip
    for indent, name, tabs in cases:
        column = 40 if indent == 1 else 48
        assert field(indent, name, "V", column) == "\t" * indent + name + ":" + "\t" * tabs + "V"


def test_device_text_names_enumerations_as_ibv_devinfo_does() -> None:
    attr, port = real_attrs()
    ib = dataclasses.replace(
        attr, transport=Transport.IB, atomic_cap=AtomicCap.HCA, fw_ver="", max_srq=0, hw_ver=0xA0
    )
    ports = [
        (1, dataclasses.replace(port, state=PortState.DOWN, active_mtu=Mtu.MTU_1024)),
        (2, dataclasses.replace(port, state=PortState.NOP, link_layer="InfiniBand")),
    ]
    lines = device_lines("mlx_test", "rdmacore", ib, ports, verbose=True)
    assert lines[:2] == ["hca_id:\tmlx_test", "\ttransport:\t\t\tInfiniBand (0)"]
    assert not any("fw_ver" in line for line in lines)  # empty: left out, as ibv_devinfo does
    assert "\thw_ver:\t\t\t\t0xA0" in lines
    assert "\tatomic_cap:\t\t\tATOMIC_HCA (1)" in lines
    assert "\tmax_srq:\t\t\t0" in lines and not any("max_srq_wr" in line for line in lines)
    assert "\tbackend:\t\t\trdmacore" in lines
    assert lines.count("\t\tport:\t1") == 1 and lines.count("\t\tport:\t2") == 1
    assert "\t\t\tstate:\t\t\tPORT_DOWN (1)" in lines
    assert "\t\t\tstate:\t\t\tinvalid state (0)" in lines
    assert "\t\t\tactive_mtu:\t\t1024 (3)" in lines
    assert "\t\t\tlink_layer:\t\tInfiniBand" in lines
    assert lines[-1] == ""  # a blank line closes each port


def test_ib_fields_the_records_carry() -> None:
    attr, port = real_attrs()
    ib = dataclasses.replace(attr, sys_image_guid=0x0002C90300A1B2C3, device_cap_flags=0x21)
    lid = dataclasses.replace(port, lid=7, sm_lid=1, lmc=2, port_cap_flags=0x2510868)
    lines = device_lines("mlx_test", "rdmacore", ib, [(1, lid)], verbose=True)
    assert "\tsys_image_guid:\t\t\t0002:c903:00a1:b2c3" in lines
    assert "\tdevice_cap_flags:\t\t0x00000021" in lines
    i = lines.index("\t\t\tactive_mtu:\t\t" + mtu_text(port.active_mtu))
    assert lines[i + 1 : i + 4] == [
        "\t\t\tsm_lid:\t\t\t1",
        "\t\t\tport_lid:\t\t7",
        "\t\t\tport_lmc:\t\t0x02",
    ]
    assert "\t\t\tport_cap_flags:\t\t0x02510868" in lines


def test_default_text_leaves_the_verbose_fields_out() -> None:
    attr, port = real_attrs()
    text = "\n".join(device_lines("siw_lo", "softiwarp", attr, [(1, port)]))
    for name in VERBOSE_ONLY:
        assert f"{name}:" not in text


def test_list_counts_like_ibv_devinfo() -> None:
    assert list_lines(["a"]) == ["1 HCA found:", "\ta", ""]
    assert list_lines(["a", "b"]) == ["2 HCAs found:", "\ta", "\tb", ""]
    assert list_lines([]) == ["0 HCAs found:", ""]


# ------------------------------------------------------------------ the command
def test_devinfo_of_siw_lo() -> None:
    out = run("devinfo", "-d", "siw_lo")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "hca_id:\tsiw_lo"
    assert "\ttransport:\t\t\tiWARP (1)" in lines
    assert GUID.search(out.stdout), out.stdout
    assert re.search(r"^\tvendor_id:\t\t\t0x[0-9a-f]{4,}$", out.stdout, re.MULTILINE)
    assert "\tphys_port_cnt:\t\t\t1" in lines
    assert "\t\tport:\t1" in lines
    assert "\t\t\tstate:\t\t\tPORT_ACTIVE (4)" in lines  # lo is always up
    assert "\t\t\tmax_mtu:\t\t4096 (5)" in lines
    assert re.search(r"^\t\t\tactive_mtu:\t\t(256|512|1024|2048|4096) \([1-5]\)$", out.stdout, re.M)
    assert "\t\t\tlink_layer:\t\tEthernet" in lines
    for name in VERBOSE_ONLY:
        assert f"{name}:" not in out.stdout


def test_verbose_adds_the_device_capabilities() -> None:
    out = run("devinfo", "--ib-dev", "siw_lo", "-v")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.search(r"^\tmax_mr_size:\t\t\t0x[0-9a-f]+$", out.stdout, re.MULTILINE)
    assert re.search(r"^\tpage_size_cap:\t\t\t0x[0-9a-f]+$", out.stdout, re.MULTILINE)
    for name in ("max_qp", "max_qp_wr", "max_sge", "max_cq", "max_cqe", "max_mr", "max_pd",
                 "max_qp_rd_atom", "max_qp_init_rd_atom", "max_srq", "max_srq_wr"):  # fmt: skip
        assert re.search(rf"^\t{name}:\t+\d+$", out.stdout, re.MULTILINE), name
    assert "\tatomic_cap:\t\t\tATOMIC_NONE (0)" in lines  # iWARP has no atomics here
    assert "\t\t\tmax_msg_sz:\t\t0xffffffff" in lines
    assert "\t\t\tnetdev:\t\t\tlo" in lines


def test_without_a_device_every_device_is_shown_and_list_names_them() -> None:
    listed = run("devinfo", "-l")
    assert listed.returncode == 0, listed.stderr
    head, *names = listed.stdout.splitlines()
    assert names[-1] == "" and all(name.startswith("\t") for name in names[:-1])
    names = [name.strip() for name in names[:-1]]
    assert "siw_lo" in names
    assert head == f"{len(names)} HCA{'' if len(names) == 1 else 's'} found:"
    every = run("devinfo")
    assert every.returncode == 0, every.stderr
    shown = re.findall(r"^hca_id:\t(\S+)$", every.stdout, re.MULTILINE)
    assert shown == names
    assert len(GUID.findall(every.stdout)) == len(names)


def test_ib_port_selects_one_port() -> None:
    out = run("devinfo", "-d", "siw_lo", "-i", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\t\tport:\t") == 1 and "\t\tport:\t1" in out.stdout.splitlines()


def test_ib_port_out_of_range_is_one_line_and_usage_status() -> None:
    out = run("devinfo", "-d", "siw_lo", "--ib-port", "2")
    assert_one_error_line(out, 2, "-i 2: no such port (siw_lo has 1 port)")
    assert out.stdout == ""
    assert_one_error_line(run("devinfo", "-i", "0"), 2, "'0' is out of range (1 .. 255)")
    assert_one_error_line(run("devinfo", "-i", "one"), 2, "'one' is not an integer")


def test_unknown_device_is_one_line() -> None:
    out = run("devinfo", "-d", "nosuch")
    assert_one_error_line(out, 1, "no device 'nosuch'")
    assert out.stdout == ""
