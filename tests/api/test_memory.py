"""Protection domains and memory regions: any buffer registered in place, keys, errors."""

from __future__ import annotations

import array
import ctypes
import errno
import mmap

import pytest

from rdmashim import Access, VerbsError

RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


def address_of(buf: object) -> int:
    """Where a writable buffer's first byte lives."""
    view = memoryview(buf).cast("B")  # type: ignore[arg-type]
    return ctypes.addressof((ctypes.c_char * view.nbytes).from_buffer(view))


async def test_pds_are_distinct(device) -> None:
    a, b = device.alloc_pd(), device.alloc_pd()
    assert a is not b


async def test_bytearray_registered_in_place(device) -> None:
    pd = device.alloc_pd()
    buf = bytearray(b"x" * 4096)
    mr = pd.reg_mr(buf, RW)
    assert (mr.addr, mr.length) == (address_of(buf), 4096)
    buf[:5] = b"hello"
    assert bytes(mr.buf[:5]) == b"hello"  # no copy: one memory, two views
    mr.buf[5:10] = b"world"
    assert buf[:10] == b"helloworld"
    for key in (mr.lkey, mr.rkey):
        assert isinstance(key, int) and 0 <= key < 1 << 32


async def test_memoryview_slice_array_and_mmap(device) -> None:
    pd = device.alloc_pd()
    base = bytearray(8192)
    sliced = pd.reg_mr(memoryview(base)[100:1100], Access.LOCAL_WRITE)
    assert (sliced.addr, sliced.length) == (address_of(base) + 100, 1000)
    doubles = array.array("d", [1.5] * 1000)
    arr = pd.reg_mr(doubles, RW)
    assert (arr.addr, arr.length) == (doubles.buffer_info()[0], 8000)
    with mmap.mmap(-1, 1 << 16) as m:
        mapped = pd.reg_mr(m, RW)
        assert (mapped.addr, mapped.length) == (address_of(m), 1 << 16)
        m[:4] = b"mmap"
        assert bytes(mapped.buf[:4]) == b"mmap"
        mapped.close()  # before the mapping goes away


async def test_read_only_buffer_without_write_access(device) -> None:
    pd = device.alloc_pd()
    ro = pd.reg_mr(b"read only data", Access.REMOTE_READ)
    assert bytes(ro.buf) == b"read only data"
    with pytest.raises(VerbsError) as info:
        pd.reg_mr(b"read only data", Access.LOCAL_WRITE)
    assert info.value.errno == errno.EACCES


async def test_keys_of_live_regions_differ(device) -> None:
    pd = device.alloc_pd()
    mrs = [pd.reg_mr(bytearray(64), RW) for _ in range(16)]
    assert len({m.lkey for m in mrs}) == 16
    assert len({m.rkey for m in mrs}) == 16


@pytest.mark.parametrize(
    ("buffer", "access", "err"),
    [
        (bytearray(64), Access.REMOTE_WRITE, errno.EINVAL),  # remote write needs LOCAL_WRITE
        (bytearray(64), Access.REMOTE_ATOMIC, errno.EINVAL),
        (42, Access.LOCAL_WRITE, errno.EINVAL),  # not a buffer
        (memoryview(bytearray(64))[::2], Access.LOCAL_WRITE, errno.EINVAL),  # not contiguous
        (bytearray(64), -1, errno.EINVAL),  # an IntFlag would make it every right
        (bytearray(64), 1 << 40, errno.EINVAL),  # a bit that is no Access
    ],
    ids=[
        "remote-write-alone",
        "remote-atomic-alone",
        "not-a-buffer",
        "strided",
        "minus-one",
        "unknown-bit",
    ],
)
async def test_registration_errors(device, buffer: object, access: Access, err: int) -> None:
    pd = device.alloc_pd()
    with pytest.raises(VerbsError) as info:
        pd.reg_mr(buffer, access)
    assert info.value.errno == err
    assert "reg_mr" in str(info.value.operation)


async def test_registered_buffer_is_pinned_until_closed(device) -> None:
    pd = device.alloc_pd()
    buf = bytearray(100)
    mr = pd.reg_mr(buf, Access.LOCAL_WRITE)
    with pytest.raises(BufferError):
        buf.extend(b"x")  # the device knows its address: it must not move
    mr.close()
    buf.extend(b"x")
    mr.close()  # idempotent


async def test_large_registration(device) -> None:
    pd = device.alloc_pd()
    size = 32 << 20
    buf = bytearray(size)
    mr = pd.reg_mr(buf, RW)
    assert mr.length == size
    mr.buf[size - 3 :] = b"end"
    assert buf[-3:] == b"end"
    mr.close()
