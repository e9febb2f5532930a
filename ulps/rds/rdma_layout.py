"""How an RDS-over-RDMA session (:mod:`.rdma_session`) lays out its buffers and work
requests: the size of a slot, how many send slots Python and C each have, the ranges of
work request ids (receives and Python's send slots by slot number, below
:data:`~.rdma_ops.RDMA_WR`; RDMA operations just above it; the Sends of plain messages
made in C and the Writes they chase from :data:`C_SEND_WR`), and a Send's flags by variant."""

from __future__ import annotations

from rdmashim.ulps.rds.rdma_ops import RDMA_WR
from rdmashim.ulps.rds.wire import RDS_FRAG_SIZE, RDS_HEADER_LEN
from rdmashim.verbs import SendFlags

SLOT = RDS_HEADER_LEN + RDS_FRAG_SIZE
"""Bytes of a receive buffer or send slot: a header and a fragment."""
SEND_SLOTS = 64
"""Python's send slots (work requests ``0..SEND_SLOTS-1``)."""
C_SEND_SLOTS = 32
"""Send buffers of plain messages sent in C (:meth:`.PlainReceiver.send`), apart from
Python's: with :data:`SEND_SLOTS` and :data:`~.rdma_ops.RDMA_DEPTH`, fewer Sends are in
flight than the QP's 128."""
C_SEND_WR = RDMA_WR << 1
"""The work request of C's send buffer ``i`` is ``C_SEND_WR + i``, and that of the RDMA
Write its message chases ``C_SEND_WR + C_SEND_SLOTS + i``."""
SEND_FLAGS = [
    (SendFlags.FENCE if variant & 8 else SendFlags.NONE)
    | (SendFlags.SOLICITED if variant & 4 else SendFlags.NONE)
    | (SendFlags.SIGNALED if variant & 2 else SendFlags.NONE)
    | (SendFlags.INLINE if variant & 1 else SendFlags.NONE)
    for variant in range(16)
]
"""A Send's flags by variant, ``fence << 3 | last fragment << 2 | signaled << 1 | inline``:
made once, as Flag arithmetic costs a Python call each time. The last fragment of a
message (and an ack) is solicited, as C's Sends are: a Linux peer arms its receive CQ for
solicited completions only (``ib_cm.c`` ``rds_ib_setup_qp``; ``ib_send.c``
``rds_ib_xmit`` solicits a message's last fragment, ``ib_recv.c``
``rds_ib_recv_init_ack`` every ack), so it would not look at what came before until a
solicited Send arrives."""
