"""``rdmashim nfs``: the NFS/RDMA server's command line (:mod:`.cli`).

``rdmashim nfs serve DIR`` exports a directory over NFSv3 on RPC-over-RDMA
and TCP with MOUNT and rpcbind (:mod:`rdmashim.ulps.nfsrdma.server`);
``rdmashim nfs ls|stat|get|put|mkdir|rm SERVER:/export/path`` are its client
(:mod:`.client_cli`, over :mod:`rdmashim.ulps.nfsrdma.client`).
"""
