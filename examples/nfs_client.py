"""The NFS/RDMA client in a program, against a server started in the same program.

The server exports a fresh temporary directory over NFSv3 on RPC-over-RDMA (and
TCP), with MOUNT and its own rpcbind, all on free ports of 127.0.0.1. The client
asks that rpcbind for the ports, mounts the export over RDMA, writes a file,
lists the directory and reads the file back.
Run it: ``python examples/nfs_client.py`` (built-in engine, loopback).
"""

import io
import tempfile
from pathlib import Path

import trio

from rdmashim.ulps.nfsrdma import NfsClient, ServerConfig, serve_nfs

DATA = b"hello over NFS/RDMA\n" * 1000  # 20 000 bytes: more than one inline message


async def main():
    with tempfile.TemporaryDirectory() as tmp:
        export = Path(tmp) / "export"
        export.mkdir()
        config = ServerConfig(
            export, host="127.0.0.1", tcp_port=0, rdma_port=0, rpcbind_port=0,  # 0: any free port
            state_dir=Path(tmp) / "state",  # where the server keeps its file handle keys
            root_squash=False,  # the only client is this program: no need to map root to nobody
        )  # fmt: skip
        async with trio.open_nursery() as nursery:
            serving = await nursery.start(serve_nfs, config)  # the export's name and its ports
            async with NfsClient.connect(
                "127.0.0.1", serving.export, proto="rdma", rpcbind_port=serving.rpcbind_port
            ) as nfs:
                await nfs.write_file("/hello.txt", io.BytesIO(DATA), len(DATA))
                for name, attrs in await nfs.listdir("/"):
                    print(f"{name}: {attrs.size} bytes")
                copy = io.BytesIO()
                await nfs.read_file("/hello.txt", copy)
                print("read back the same bytes:", copy.getvalue() == DATA)
            print("on the server's disk:", (export / "hello.txt").read_bytes() == DATA)
            nursery.cancel_scope.cancel()


trio.run(main)
