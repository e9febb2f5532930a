"""IBAT path queries over real interfaces: loopback here, and a namespace pair for neighbours."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import psutil
import pytest

from rdmashim.providers.ibal import IbError, IbStatus
from rdmashim.providers.ibal.ibat import GID_LEN, ibat_query_path, iwarp_gid
from rdmashim.providers.softiwarp import get_device_list

import netns


def _loopback() -> str:
    return next(name for name, st in psutil.net_if_stats().items() if "loopback" in st.flags)


@pytest.mark.parametrize("dst", ["127.0.0.1", "::1"])
def test_loopback_path_is_the_loopback_devices_gid_both_ways(dst: str) -> None:
    path = ibat_query_path(None, dst)
    lo = _loopback()
    device = next(d for d in get_device_list() if d.netdev == lo)
    assert path.src_ip == dst and path.dst_ip == dst
    assert path.ifname == lo and path.device_name == device.name
    assert path.ca_guid == device.node_guid
    assert path.sgid == path.dgid == iwarp_gid(lo, device)
    assert len(path.sgid) == GID_LEN and any(path.sgid) and not any(path.sgid[6:])
    assert path.dlid == path.slid == 0 and path.pkey == 0xFFFF
    assert path.mtu_bytes == 4096  # loopback's MTU is far above IB's largest


def test_a_local_address_of_another_interface_resolves_to_its_mac() -> None:
    for name, entries in psutil.net_if_addrs().items():
        macs = [e.address for e in entries if e.family == psutil.AF_LINK and e.address]
        ips = [e.address for e in entries if e.family == 2]
        if ips and macs and any(bytes.fromhex(macs[0].replace(":", ""))):
            ifname = name
            break
    else:
        pytest.skip("no interface with an IPv4 address and a MAC here")
    path = ibat_query_path(None, ips[0])
    assert path.ifname == ifname
    assert path.dgid[:6] == bytes.fromhex(macs[0].replace(":", "")) == path.sgid[:6]


def test_bad_addresses_are_invalid_parameters() -> None:
    with pytest.raises(IbError) as info:
        ibat_query_path(None, "not-an-ip")
    assert info.value.status is IbStatus.IB_INVALID_PARAMETER
    with pytest.raises(IbError) as info:
        ibat_query_path("127.0.0.1", "::1")
    assert info.value.status is IbStatus.IB_INVALID_PARAMETER


def test_a_source_no_interface_owns_is_not_found() -> None:
    with pytest.raises(IbError) as info:
        ibat_query_path("192.0.2.254" if _owner("192.0.2.254") is None else "198.51.100.254",
                        "127.0.0.1")  # fmt: skip
    assert info.value.status is IbStatus.IB_NOT_FOUND
    assert "no local interface" in str(info.value)


def _owner(address: str) -> str | None:
    from rdmashim.cm.addressing import interface_of

    return interface_of(address)


# ---------------------------------------------------------------------------- two hosts
_QUERY = """
import json, sys
from rdmashim.providers.ibal import IbError
from rdmashim.providers.ibal.ibat import ibat_query_path
src, dst, timeout = json.loads(sys.argv[1])
try:
    p = ibat_query_path(src, dst, timeout=timeout)
    print(json.dumps({"sgid": p.sgid.hex(), "dgid": p.dgid.hex(), "src": p.src_ip,
                      "ifname": p.ifname, "device": p.device_name}))
except IbError as e:
    print(json.dumps({"status": e.status.name, "detail": e.detail}))
"""


def _query(host: netns.Host, src: str | None, dst: str, timeout: float = 3.0) -> dict[str, Any]:
    argv = ["ip", "netns", "exec", host.netns, sys.executable, "-c", _QUERY]
    done = subprocess.run(
        [*argv, json.dumps([src, dst, timeout])], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _mac(host: netns.Host, ifname: str) -> str:
    link = json.loads(host.ip("-j", "link", "show", ifname).stdout)[0]
    return link["address"].replace(":", "")


@pytest.mark.parametrize("dst", ["10.201.0.2", "fd00:201::2"])
def test_a_neighbour_resolves_to_its_mac(net: netns.Network, dst: str) -> None:
    got = _query(net.a, None, dst)
    assert got["ifname"] == "va0" and got["device"] == "siw_va0"
    assert got["sgid"] == _mac(net.a, "va0") + "00" * 10
    assert got["dgid"] == _mac(net.b, "vb0") + "00" * 10


def test_the_route_picks_the_interface_of_a_multihomed_host(net: netns.Network) -> None:
    got = _query(net.b, None, "10.202.0.3")
    assert got["src"] == "10.202.0.2" and got["ifname"] == "vb1"
    assert got["dgid"] == _mac(net.c, "vc1") + "00" * 10


def test_a_silent_address_times_out_and_an_unrouted_one_is_not_found(net: netns.Network) -> None:
    silent = _query(net.a, None, "10.201.0.99", timeout=0.5)
    assert silent["status"] in ("IB_TIMEOUT", "IB_NOT_FOUND"), silent
    unrouted = _query(net.a, None, "10.77.0.1")
    assert unrouted["status"] == "IB_NOT_FOUND" and "route" in unrouted["detail"]
