"""NFS/RDMA: ONC RPC over RPC-over-RDMA v1 (RFC 8166) with NFSv3 and MOUNT v3."""
