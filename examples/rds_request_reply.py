"""An RDS request and its reply between two nodes in one program.

RDS carries reliable, ordered datagrams between (IP, port) endpoints. A node is
this machine's RDS presence on one IP address; all sockets of two nodes share
one RDMA connection, which the nodes set up themselves when the first message
goes (the lower address connects). Here the nodes are 127.0.0.1 and 127.0.0.2,
both on the built-in engine over loopback (Linux treats all of 127/8 as local).
Run it: ``python examples/rds_request_reply.py [CM_PORT]``; every node of an RDS
network uses one rdma_cm port (default Linux's, 18634).
"""

import sys

import trio

from rdmashim.ulps.rds import RDS_PORT, RdsNode

CM_PORT = int(sys.argv[1]) if len(sys.argv) > 1 else RDS_PORT
SERVICE = 4000  # the RDS port the server's socket is bound to


async def serve_one(sock):
    request, sender = await sock.recvfrom()  # sender: the client's (IP, RDS port)
    await sock.sendto(b"reply to " + request, sender)


async def main():
    async with RdsNode("127.0.0.1", CM_PORT) as server, RdsNode("127.0.0.2", CM_PORT) as client:
        service = server.bind(SERVICE)
        caller = client.bind(0)  # 0: any free RDS port
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_one, service)
            await caller.sendto(b"a request", ("127.0.0.1", SERVICE))
            reply, (ip, port) = await caller.recvfrom()
        print(f"{ip}:{port} answered {reply!r}")


trio.run(main)
