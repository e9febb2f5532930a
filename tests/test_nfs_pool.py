"""The buffer pool (:mod:`rdmashim.ulps.nfsrdma.pool`): a buffer goes out again only when
nothing refers to it, from any thread; READ's data comes from it and never shows an
earlier READ's bytes."""

from __future__ import annotations

import io
import os
import sys
import threading
import warnings
from pathlib import Path

import pytest
import trio
from test_nfs_server import CRED, nfs_server

from rdmashim.ulps.nfsrdma import nfs3, nfs3_call, rdma_client
from rdmashim.ulps.nfsrdma.client import NfsClient
from rdmashim.ulps.nfsrdma.export import Export
from rdmashim.ulps.nfsrdma.nfs3_call import PROCEDURES, RTMAX
from rdmashim.ulps.nfsrdma.nfs3_types import NFS3_OK, READ, pack_fh
from rdmashim.ulps.nfsrdma.pool import BufferPool
from rdmashim.ulps.nfsrdma.service import CallContext, Reply
from rdmashim.ulps.nfsrdma.xdr import Packer, Unpacker


def test_the_pool_gives_out_only_buffers_no_one_holds() -> None:
    pool = BufferPool(keep=2)
    first = id(pool.take(119))  # the id only: a reference would hold it
    assert id(pool.take(119)) == first  # no one held it
    view = memoryview(pool.take(119))[20:30]  # the same buffer, held by a slice
    second = pool.take(119)
    assert len(second) >= 119 and id(second) != first
    third = pool.take(119)  # both kept ones are held: one more, not kept
    assert id(third) not in (first, id(second))
    assert pool.made == 3
    del view, second, third
    assert id(pool.take(119)) == first  # nothing holds it any more
    bigger = pool.take(5019)  # none is large enough: a new one replaces a small one
    assert id(bigger) != first and pool.made == 4
    assert pool.take(5019) is not bigger  # held here


def test_a_reused_buffer_is_zeroed_unless_the_caller_says_not() -> None:
    """What a server leaves unwritten in a reused buffer reads as zeros, as in a fresh
    one; ``zero=False`` hands it out as it is (the caller writes what it reads)."""
    pool = BufferPool(keep=1)
    buf = pool.take(119)
    buf[:] = b"\xab" * len(buf)  # an earlier reply's bytes
    first = id(buf)
    del buf
    again = pool.take(119)
    assert id(again) == first and again == bytes(len(again))
    again[:] = b"\xcd" * len(again)
    del again
    assert pool.take(119, zero=False) == b"\xcd" * 119


def test_threads_never_get_the_same_buffer() -> None:
    """Threads taking and dropping buffers at once: no buffer is out twice at a time
    (each holder writes its mark and finds it still there)."""
    pool = BufferPool(keep=4)
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    failures: list[str] = []

    def worker(mark: int) -> None:
        for _ in range(2000):
            buf = pool.take(64, zero=False)
            buf[:] = bytes([mark]) * len(buf)
            if buf != bytes([mark]) * len(buf):
                failures.append(f"thread {mark} shared a buffer")
                return
            del buf

    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(1, 9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(0.005)
    assert not failures


def _read(program: nfs3.Nfs3Program, fh: bytes, offset: int, count: int) -> memoryview:
    """A READ carried out as a worker thread would: its reply's data."""
    args = Packer()
    pack_fh(args, fh)
    args.uhyper(offset)
    args.uint(count)
    ctx = CallContext(1, 100003, 3, READ, None, ("127.0.0.1", 700), "tcp")
    reply = Reply()
    program.run(PROCEDURES[READ], ctx, Unpacker(args.data), reply)
    assert reply.packer.data[:4] == NFS3_OK.to_bytes(4, "big")
    ((_, data),) = reply.ddp
    return data


def test_read_data_comes_from_the_pool_and_shows_no_earlier_read(tmp_path: Path) -> None:
    """A READ at the end of a file reads fewer bytes than the buffer, which held a
    longer READ before: only the bytes read are in the reply."""
    served, state = tmp_path / "export", tmp_path / "state"
    served.mkdir()
    state.mkdir()
    whole = os.urandom(RTMAX + 5000)
    (served / "f").write_bytes(whole)
    program = nfs3.Nfs3Program(Export(served, state_dir=state))
    export = program.exports[0]
    fh = export.handle(export.child(export.root(), "f"))
    first = _read(program, fh, 0, RTMAX)
    assert first == whole[:RTMAX]
    buffer = id(first.obj)  # (the id only: a reference would hold it)
    del first
    tail = _read(program, fh, RTMAX, RTMAX)  # 5000 bytes left
    assert id(tail.obj) == buffer  # the same memory again: no megabyte made per READ
    assert bytes(tail) == whole[RTMAX:]
    del tail
    assert len(_read(program, fh, RTMAX + 5000, RTMAX)) == 0  # at the end: nothing
    assert program.state.read_buffers.made == 1


def test_the_old_name_still_works_with_a_warning() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert rdma_client.ReceivePool is BufferPool
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    with pytest.raises(AttributeError):
        rdma_client.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("proto", ["rdma", "tcp"])
async def test_many_clients_reading_at_once_each_get_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, proto: str
) -> None:
    """Five clients read a file at once, four READs in flight each: more READs at work
    than the pool keeps buffers, so some are made afresh and the others reused while
    their earlier READs' replies may still be going out. Every client gets the file's
    bytes, and the pool did reuse."""
    pools: list[BufferPool] = []

    class Counted(BufferPool):
        def __init__(self, keep: int) -> None:
            super().__init__(keep)
            pools.append(self)

    monkeypatch.setattr(nfs3_call, "BufferPool", Counted)
    whole = os.urandom(6 * RTMAX + 1234)
    got: dict[int, bytes] = {}
    with trio.fail_after(120):
        async with nfs_server(tmp_path) as (serving, export):
            (export / "big").write_bytes(whole)

            async def read(i: int) -> None:
                async with NfsClient.connect(
                    "127.0.0.1", serving.export, proto=proto,  # type: ignore[arg-type]
                    rpcbind_port=serving.rpcbind_port or 0, cred=CRED,
                ) as nfs:  # fmt: skip
                    sink = io.BytesIO()
                    await nfs.read_file("big", sink)
                    got[i] = sink.getvalue()

            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(read, i)
    assert sorted(got) == list(range(5))
    assert all(data == whole for data in got.values())
    made = sum(pool.made for pool in pools)  # (NFS's; NLM's server state reads nothing)
    reads = 5 * 7
    assert 0 < made < reads  # buffers were reused
