"""rpcbind (RFC 1833) through the TCP transport, registration, and rpcinfo as a real peer."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from nfsecho import ECHO_PROG, Echo
from test_nfs_server import nfs_server

from rdmashim.ulps.nfsrdma.rpc import (
    AuthError,
    GarbageArgs,
    ProcUnavail,
    ProgMismatch,
    ProgUnavail,
    RpcMismatch,
    RpcServer,
    decode_reply,
    encode_call,
)
from rdmashim.ulps.nfsrdma.rpcbind import (
    Binding,
    Registry,
    Rpcbind,
    merged_uaddr,
    pack_binding,
    parse_uaddr,
    register_with_rpcbind,
    uaddr,
    unpack_binding,
)
from rdmashim.ulps.nfsrdma.service import AuthSys, Reply
from rdmashim.ulps.nfsrdma.tcp import RpcTcpClient, connect_tcp, serve_tcp
from rdmashim.ulps.nfsrdma.xdr import Unpacker

RPCBIND, NFS, MOUNT = 100000, 100003, 100005


def test_universal_addresses() -> None:
    assert uaddr("192.0.2.5", 20049) == "192.0.2.5.78.81"
    assert uaddr("::1", 2049) == "::1.8.1"
    assert parse_uaddr("192.0.2.5.78.81") == ("192.0.2.5", 20049)
    assert parse_uaddr("fe80::1.0.111") == ("fe80::1", 111)
    for bad in ("192.0.2.5.78", "192.0.2.5.256.1", "host.1.2", "1.2.3.4.x.1", ""):
        with pytest.raises(ValueError):
            parse_uaddr(bad)
    with pytest.raises(ValueError):
        uaddr("127.0.0.1", 65536)


def nfs_registry(rpcbind_port: int) -> Registry:
    registry = Registry()
    for vers in (2, 3, 4):
        assert registry.add(RPCBIND, vers, "tcp", rpcbind_port)
    assert registry.add(NFS, 3, "tcp", 2049)
    assert registry.add(NFS, 3, "rdma", 20049)
    assert registry.add(MOUNT, 3, "tcp", 20048)
    assert not registry.add(MOUNT, 3, "tcp", 1)  # taken
    return registry


def mapping(prog: int, vers: int, prot: int = 6, port: int = 0) -> Reply:
    args = Reply()
    for value in (prog, vers, prot, port):
        args.packer.uint(value)
    return args


def rpcb(prog: int, vers: int, netid: str = "", address: str = "") -> Reply:
    args = Reply()
    pack_binding(args.packer, Binding(prog, vers, netid, address, ""))
    return args


def read_list(results: Unpacker, item: int) -> list[tuple[int, ...]]:
    out = []
    while results.boolean():
        out.append(tuple(results.uint() for _ in range(item)))
    results.done()
    return out


def read_bindings(results: Unpacker) -> list[Binding]:
    out = []
    while results.boolean():
        out.append(unpack_binding(results))
    results.done()
    return out


@pytest.fixture
async def served(nursery: trio.Nursery) -> AsyncIterator[tuple[int, Registry]]:
    registry = Registry()
    server = RpcServer([Rpcbind(registry), Echo()])
    listeners = await nursery.start(serve_tcp, server, 0, "127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    for binding in nfs_registry(port).bindings():
        registry.set(binding)
    registry.add(ECHO_PROG, 1, "tcp", port)
    yield port, registry


async def test_portmapper_v2(served: tuple[int, Registry]) -> None:
    port, _ = served
    async with connect_tcp("127.0.0.1", port) as client:
        assert (await client.call(RPCBIND, 2, 0)).remaining() == 0
        assert (await client.call(RPCBIND, 2, 3, mapping(NFS, 3))).uint() == 2049
        assert (await client.call(RPCBIND, 2, 3, mapping(NFS, 4))).uint() == 2049  # other version
        assert (await client.call(RPCBIND, 2, 3, mapping(NFS, 3, prot=17))).uint() == 0
        assert (await client.call(RPCBIND, 2, 3, mapping(200, 1))).uint() == 0
        dump = read_list(await client.call(RPCBIND, 2, 4), 4)
        assert dump == [
            (RPCBIND, 2, 6, port),
            (RPCBIND, 3, 6, port),
            (RPCBIND, 4, 6, port),
            (NFS, 3, 6, 2049),  # not the rdma binding: v2 knows protocol numbers only
            (MOUNT, 3, 6, 20048),
            (ECHO_PROG, 1, 6, port),
        ]
        with pytest.raises(ProcUnavail):
            await client.call(RPCBIND, 2, 5, mapping(NFS, 3))  # CALLIT


async def test_rpcbind_v3_v4_getaddr(served: tuple[int, Registry]) -> None:
    port, _ = served
    async with connect_tcp("127.0.0.1", port) as client:
        for vers in (3, 4):
            got = await client.call(RPCBIND, vers, 3, rpcb(NFS, 3, "rdma"))
            assert got.string() == "127.0.0.1.78.81"
            assert (await client.call(RPCBIND, vers, 3, rpcb(NFS, 3))).string() == "127.0.0.1.8.1"
            assert (
                await client.call(RPCBIND, vers, 3, rpcb(NFS, 4, "tcp"))
            ).string() == "127.0.0.1.8.1"
            assert (await client.call(RPCBIND, vers, 3, rpcb(42, 1, "tcp"))).string() == ""
        assert (await client.call(RPCBIND, 4, 9, rpcb(NFS, 4, "tcp"))).string() == ""  # GETVERSADDR
        assert (await client.call(RPCBIND, 4, 9, rpcb(NFS, 3, "tcp"))).string() == "127.0.0.1.8.1"
        with pytest.raises(ProcUnavail):
            await client.call(RPCBIND, 3, 9, rpcb(NFS, 3, "tcp"))
        assert (await client.call(RPCBIND, 3, 6)).uint() > 0  # GETTIME
        dump = read_bindings(await client.call(RPCBIND, 4, 4))
        assert Binding(NFS, 3, "rdma", "0.0.0.0.78.81") in dump
        assert len(dump) == 7


async def test_set_and_unset_from_loopback(served: tuple[int, Registry]) -> None:
    port, registry = served
    async with connect_tcp("127.0.0.1", port, cred=AuthSys(0, "h", 1000, 1000)) as client:
        assert (await client.call(RPCBIND, 4, 1, rpcb(300000, 1, "tcp", "127.0.0.1.4.0"))).boolean()
        assert not (
            await client.call(RPCBIND, 4, 1, rpcb(300000, 1, "tcp", "127.0.0.1.4.1"))
        ).boolean()
        assert Binding(300000, 1, "tcp", "127.0.0.1.4.0", "1000") in registry.bindings()
        assert (await client.call(RPCBIND, 2, 3, mapping(300000, 1))).uint() == 1024
        assert (await client.call(RPCBIND, 4, 2, rpcb(300000, 1))).boolean()
        assert not (await client.call(RPCBIND, 4, 2, rpcb(300000, 1))).boolean()
        assert (await client.call(RPCBIND, 2, 1, mapping(300001, 2, 17, 999))).boolean()
        assert (
            await client.call(RPCBIND, 3, 3, rpcb(300001, 2, "udp"))
        ).string() == "127.0.0.1.3.231"
        assert not (await client.call(RPCBIND, 2, 1, mapping(300002, 2, 99, 999))).boolean()
        assert (await client.call(RPCBIND, 2, 2, mapping(300001, 2))).boolean()
        assert registry.lookup(300001, 2, "udp") is None


async def test_set_and_unset_from_another_host_are_refused() -> None:
    registry = nfs_registry(111)
    server = RpcServer([Rpcbind(registry)])

    async def ask(vers: int, proc: int, args: Reply) -> bool:
        call = encode_call(1, RPCBIND, vers, proc, None, args)
        reply = await server.handle_call(
            memoryview(bytes(call.packer.data)), ("192.0.2.9", 700), "tcp"
        )
        assert reply is not None
        return decode_reply(bytes(reply.packer.data))[1].boolean()

    before = registry.bindings()
    assert not await ask(4, 1, rpcb(300000, 1, "tcp", "192.0.2.9.4.0"))
    assert not await ask(4, 2, rpcb(NFS, 3))
    assert not await ask(2, 1, mapping(300000, 1, 6, 1024))
    assert not await ask(2, 2, mapping(NFS, 3))
    assert registry.bindings() == before


class PortmapperOnly(Rpcbind):
    """An rpcbind that speaks version 2 only, like an old portmap."""

    versions = (2, 2)


@pytest.mark.parametrize("program", [Rpcbind, PortmapperOnly])
async def test_register_with_rpcbind(nursery: trio.Nursery, program: type[Rpcbind]) -> None:
    registry = Registry()
    listeners = await nursery.start(serve_tcp, RpcServer([program(registry)]), 0, "127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    stale = Binding(NFS, 3, "tcp", "0.0.0.0.0.99")
    registry.set(stale)
    ours = [Binding(NFS, 3, "tcp", "0.0.0.0.8.1"), Binding(NFS, 3, "rdma", "0.0.0.0.78.81")]
    done = await register_with_rpcbind(ours, "127.0.0.1", port)
    assert done == [True, program is Rpcbind]  # a portmapper cannot hold the rdma netid
    assert stale not in registry.bindings()
    assert registry.lookup(NFS, 3, "tcp") is not None
    assert registry.lookup(NFS, 3, "tcp").port == 2049  # type: ignore[union-attr]
    await register_with_rpcbind(ours, "127.0.0.1", port, unset=True)
    assert registry.bindings() == []


RPCINFO = shutil.which("rpcinfo") or shutil.which("rpcinfo", path="/usr/sbin:/sbin")


@pytest.mark.skipif(RPCINFO is None, reason="rpcinfo is not installed (apt-get install rpcbind)")
async def test_rpcinfo_finds_the_versions_and_pings(served: tuple[int, Registry]) -> None:
    port, _ = served
    assert RPCINFO is not None
    # -a ADDRESS: no rpcbind lookup; without a version, a version-0 probe whose
    # PROG_MISMATCH gives the range, then a NULL call to each version
    for prog, versions in ((RPCBIND, (2, 3, 4)), (ECHO_PROG, (1, 2))):
        done = await trio.run_process(
            [RPCINFO, "-a", uaddr("127.0.0.1", port), "-T", "tcp", str(prog)], capture_stdout=True
        )
        lines = done.stdout.decode().splitlines()
        assert lines == [f"program {prog} version {v} ready and waiting" for v in versions]
    done = await trio.run_process(
        [RPCINFO, "-a", uaddr("127.0.0.1", port), "-T", "tcp", "42", "1"],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert done.returncode != 0
    assert b"Program unavailable" in done.stderr  # PROG_UNAVAIL, as rpcinfo reads it


async def test_rpcbind_client_over_a_client_object(served: tuple[int, Registry]) -> None:
    port, _ = served
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream, trio.open_nursery() as nursery:
        client = RpcTcpClient(stream)
        nursery.start_soon(client.run)
        assert (await client.call(RPCBIND, 2, 3, mapping(MOUNT, 3))).uint() == 20048
        nursery.cancel_scope.cancel()


def test_getaddr_names_the_address_asked_for_a_wildcard_binding() -> None:
    assert merged_uaddr("0.0.0.0.8.1", "10.201.0.2") == "10.201.0.2.8.1"
    assert merged_uaddr("0.0.0.0.8.1", "::ffff:10.0.0.1") == "10.0.0.1.8.1"
    assert merged_uaddr("::.8.1", "fd00::2") == "fd00::2.8.1"
    for kept, local in (
        ("0.0.0.0.8.1", ""),  # the transport could not say
        ("0.0.0.0.8.1", "0.0.0.0"),
        ("0.0.0.0.8.1", "fd00::2"),  # the other family
        ("127.0.0.1.8.1", "10.201.0.2"),  # a binding on one address is that address
        ("/run/rpcbind.sock", "10.201.0.2"),  # not an internet address
    ):
        assert merged_uaddr(kept, local) == kept


@asynccontextmanager
async def udp_socket(port: int) -> AsyncIterator[trio.socket.SocketType]:
    with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        await sock.connect(("127.0.0.1", port))
        yield sock


async def udp_call(
    port: int, prog: int, vers: int, proc: int, args: Reply | None = None
) -> Unpacker:
    """One call in one datagram, its reply decoded (an RpcError for a refusal)."""
    async with udp_socket(port) as sock:
        await sock.send(bytes(encode_call(9, prog, vers, proc, None, args or Reply()).packer.data))
        with trio.fail_after(5):
            return decode_reply(await sock.recv(65536))[1]


async def test_serve_nfs_runs_rpcbind_on_tcp_and_udp_and_registers_it(tmp_path: Path) -> None:
    """Before, program 100000 was not in its own registry (rpcinfo -p: "Program not
    registered") and nothing answered over UDP."""
    async with nfs_server(tmp_path) as (serving, _):
        port = serving.rpcbind_port
        assert port is not None
        async with connect_tcp("127.0.0.1", port) as client:
            dump = read_list(await client.call(RPCBIND, 2, 4), 4)
        for vers in (2, 3, 4):
            assert (RPCBIND, vers, 6, port) in dump and (RPCBIND, vers, 17, port) in dump
        assert (NFS, 3, 6, serving.tcp_port) in dump
        assert (await udp_call(port, RPCBIND, 2, 0)).remaining() == 0  # NULL
        assert (await udp_call(port, RPCBIND, 2, 3, mapping(RPCBIND, 2, 17))).uint() == port
        assert (await udp_call(port, RPCBIND, 2, 3, mapping(MOUNT, 3))).uint() == serving.tcp_port
        for vers in (3, 4):  # the address the query came to, not 0.0.0.0
            got = await udp_call(port, RPCBIND, vers, 3, rpcb(RPCBIND, vers, "udp"))
            assert got.string() == uaddr("127.0.0.1", port)
        udp_dump = read_bindings(await udp_call(port, RPCBIND, 4, 4))
        assert Binding(RPCBIND, 2, "udp", uaddr("127.0.0.1", port)) in udp_dump
        assert Binding(NFS, 3, "rdma", uaddr("127.0.0.1", serving.rdma_port or 0)) in udp_dump
        assert read_bindings(await udp_call(port, RPCBIND, 3, 4)) == udp_dump  # v3's DUMP
        with pytest.raises(ProgUnavail):  # UDP answers rpcbind only
            await udp_call(port, NFS, 3, 0)


async def test_hostile_datagrams_are_answered_or_dropped_and_the_server_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def call(rpcvers: int = 2, vers: int = 2, proc: int = 3, cred: int = 0) -> bytes:
        head = [7, 0, rpcvers, RPCBIND, vers, proc, cred, 0, 0, 0]
        return b"".join(v.to_bytes(4, "big") for v in head)

    answered = [  # (datagram, what decoding its reply raises)
        (call(rpcvers=3), RpcMismatch),
        (call(vers=9), ProgMismatch),
        (call(proc=77), ProcUnavail),
        (call(cred=6), AuthError),  # RPCSEC_GSS
        (call() + b"\x00" * 5, GarbageArgs),  # GETPORT's mapping cut short
        (call()[:30], AuthError),  # cut inside the credential: AUTH_BADCRED
        (call()[:18], GarbageArgs),  # cut inside the procedure number
    ]
    dropped = [b"", b"\x00\x01", (7).to_bytes(4, "big") + (1).to_bytes(4, "big"), os.urandom(60000)]
    caplog.set_level(logging.INFO, "rdmashim.ulps.nfsrdma")
    async with nfs_server(tmp_path) as (serving, _):
        port = serving.rpcbind_port
        assert port is not None
        for datagram, error in answered:
            async with udp_socket(port) as sock:
                await sock.send(datagram)
                with trio.fail_after(5), pytest.raises(error):
                    decode_reply(await sock.recv(65536))
        for datagram in dropped:
            async with udp_socket(port) as sock:
                await sock.send(datagram)
                with trio.move_on_after(0.3) as wait:
                    await sock.recv(65536)
                assert wait.cancelled_caught, f"{datagram[:8]!r} was answered"
        async with udp_socket(port) as sock:  # a sender gone before its reply: ICMP, no harm
            await sock.send(call(proc=0))
        assert (await udp_call(port, RPCBIND, 4, 3, rpcb(NFS, 3, "tcp"))).string()  # still here
    said = [r.getMessage() for r in caplog.records if r.name.endswith(".rpc")]
    assert sum("without a header" in line for line in said) >= 2, said
    assert any("is not a call" in line for line in said), said


async def _rpcinfo_agent() -> None:
    """Inside a fresh network namespace: our rpcbind on port 111, rpcinfo's answers as JSON."""
    assert RPCINFO is not None
    async with trio.open_nursery() as nursery:
        registry = nfs_registry(111)
        registry.add(ECHO_PROG, 1, "tcp", 111)
        server = RpcServer([Rpcbind(registry), Echo()])
        await nursery.start(serve_tcp, server, 111, "127.0.0.1")
        outputs = {}
        for flags in (["-p"], ["-s"], ["-T", "tcp"]):
            tail = [str(ECHO_PROG), "1"] if "-T" in flags else []
            done = await trio.run_process(
                [RPCINFO, *flags, "127.0.0.1", *tail],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            outputs[" ".join(flags)] = (done.returncode, done.stdout.decode(), done.stderr.decode())
        sys.stdout.write(json.dumps(outputs))
        nursery.cancel_scope.cancel()


UNSHARE = shutil.which("unshare")


@pytest.mark.skipif(RPCINFO is None, reason="rpcinfo is not installed (apt-get install rpcbind)")
@pytest.mark.skipif(UNSHARE is None or os.geteuid() != 0, reason="needs root and unshare")
async def test_rpcinfo_against_our_rpcbind_on_port_111() -> None:

    here = Path(__file__)
    script = f"ip link set lo up && exec {sys.executable} {here} --rpcinfo-agent"
    done = await trio.run_process(
        [str(UNSHARE), "-n", "sh", "-c", script], capture_stdout=True, cwd=here.parent
    )
    outputs = {flags: tuple(result) for flags, result in json.loads(done.stdout).items()}
    code, out, err = outputs["-p"]
    assert code == 0, err
    rows = [line.split()[:4] for line in out.splitlines()[1:]]
    assert ["100003", "3", "tcp", "2049"] in rows
    assert ["100005", "3", "tcp", "20048"] in rows
    code, out, err = outputs["-s"]
    assert code == 0, err
    assert any(line.split()[:3] == ["100003", "3", "rdma,tcp"] for line in out.splitlines()), out
    code, out, err = outputs["-T tcp"]
    assert (code, out.strip()) == (0, f"program {ECHO_PROG} version 1 ready and waiting"), err


if __name__ == "__main__" and "--rpcinfo-agent" in sys.argv:
    trio.run(_rpcinfo_agent)
