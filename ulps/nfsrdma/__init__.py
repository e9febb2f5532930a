"""NFS/RDMA: an NFSv3 + MOUNT v3 server over ONC RPC on RPC-over-RDMA v1 (RFC 8166) and TCP.

The names a user needs are here; ``docs/nfs.md`` maps the modules::

    from rdmashim.ulps.nfsrdma import NfsClient, NfsError, ServerConfig, serve_nfs

- serving: :func:`serve_nfs` with a :class:`ServerConfig` (it reports a
  :class:`Serving`), :func:`mount_command`, :class:`Export` for a program of
  one's own;
- the client: :class:`NfsClient` (:meth:`~NfsClient.connect`), which raises
  :class:`NfsError` for a status other than NFS3_OK, :class:`MountError`
  when MOUNT refuses and :class:`ServerUnreachable` when rpcbind, MOUNT or NFS
  cannot be reached; :func:`list_exports` and :func:`split_remote`;
- what they carry: :class:`Fattr3` (with its :class:`FType3`), :class:`Nfsstat3`.

The modules keep their names (``rdmashim.ulps.nfsrdma.client.NfsClient`` is
the same class).
"""

from rdmashim.ulps.nfsrdma.client import (
    MountError,
    NfsClient,
    NfsError,
    ServerUnreachable,
    list_exports,
    split_remote,
)
from rdmashim.ulps.nfsrdma.export import Export
from rdmashim.ulps.nfsrdma.nfs3_types import Fattr3, FType3, Nfsstat3
from rdmashim.ulps.nfsrdma.server import (
    NFS_RDMA_PORT,
    NFS_TCP_PORT,
    ServerConfig,
    Serving,
    mount_command,
    serve_nfs,
)

__all__ = [
    "NFS_RDMA_PORT",
    "NFS_TCP_PORT",
    "Export",
    "FType3",
    "Fattr3",
    "MountError",
    "NfsClient",
    "NfsError",
    "Nfsstat3",
    "ServerConfig",
    "ServerUnreachable",
    "Serving",
    "list_exports",
    "mount_command",
    "serve_nfs",
    "split_remote",
]
