"""NFS/RDMA: an NFSv3 + MOUNT v3 server over ONC RPC on RPC-over-RDMA v1 (RFC 8166) and TCP.

Start with :func:`rdmashim.ulps.nfsrdma.server.serve_nfs`; ``docs/nfs.md`` maps the modules.
"""
