"""RDMA by cookie over RDS: a peer writes into your buffer, and reads out of another.

A socket registers a buffer and gets a *cookie* (Linux's ``RDS_GET_MR``), an
integer it hands to a peer in an ordinary message. The peer then sends a message
carrying an ``RdmaOp`` that names the cookie: its node runs the RDMA Write (or Read)
on the buffer first and sends the message after it, so the buffer's owner finds the
data in place when the message arrives. ``await op.wait()`` tells the sender how the
operation ended. Here a server offers two buffers, one to write into and one to read
from, and a client uses both.
Run it: ``python examples/rds_rdma_cookie.py [CM_PORT]``.
"""

import sys

import trio

from rdmashim.ulps.rds import RDS_PORT, RdmaOp, RdsNode

CM_PORT = int(sys.argv[1]) if len(sys.argv) > 1 else RDS_PORT
SERVER = ("127.0.0.1", 4000)


async def server(sock):
    inbox = bytearray(32)  # the client writes here
    outbox = bytearray(b"read by RDMA".ljust(32))  # and reads this
    _, client = await sock.recvfrom()  # "your buffers, please"
    cookies = (sock.get_mr(inbox), sock.get_mr(outbox))
    await sock.sendto(b"".join(c.to_bytes(16, "big") for c in cookies), client)
    note, _ = await sock.recvfrom()  # chases the Write: the bytes are in place now
    print(f"{note.decode()}: the server's buffer holds {bytes(inbox).rstrip(bytes(1))!r}")
    await sock.recvfrom()  # chases the Read: done with both buffers
    for cookie in cookies:
        sock.free_mr(cookie)


async def client(sock):
    await sock.sendto(b"your buffers, please", SERVER)
    reply, _ = await sock.recvfrom()
    write_cookie, read_cookie = (int.from_bytes(reply[i : i + 16], "big") for i in (0, 16))
    write = RdmaOp.write_to(write_cookie, b"written by RDMA")
    await sock.sendto(b"written", SERVER, rdma=write)
    read = RdmaOp.read_into(read_cookie, bytearray(12))
    await sock.sendto(b"read", SERVER, rdma=read)
    return await write.wait(), await read.wait(), bytes(read.buffer)


async def main():
    async with (
        RdsNode(SERVER[0], CM_PORT) as one,
        RdsNode("127.0.0.2", CM_PORT) as two,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(server, one.bind(SERVER[1]))
        wrote, read, got = await client(two.bind(0))
    print(f"the client's Write: {wrote.name}; its Read: {read.name}, {got!r}")


trio.run(main)
