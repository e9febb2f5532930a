"""How an RDS-over-RDMA session (:mod:`.rdma_session`) paces what it posts: the
receives it posts again together, the Sends it asks completions for, the answers it
holds back for a burst, and the backstop of a held-back acknowledgement. Each figure is
the one measured best, with the measurement beside it."""

from __future__ import annotations

from rdmashim.ulps.rds.rdma_flow import ACK_DELAY

REPOST_BATCH = 16
"""Receive buffers go back to the QP (and their credits to the peer) in lists of at
least this many: a post per message, where one message comes at a time, costs more
than the few receives it keeps posted (at least 112 of 128 stay posted). A post of
8 cost the native engine 14-18 us (rds stress d=1, a loaded machine): 2 us a message;
of 16, half that."""
SIGNAL_EVERY = 16
"""A session asks for a completion every this many Sends (or each one when slots run
low): one completion frees the slots of every Send posted before it. Each costs a
completion handler run of its own where no receive comes with it (at one request in
flight, on the built-in engine, in its dispatcher task: a task switch too): 8 made
that 0.13 handler runs a message more, 16 makes it 0.06."""
BURST_MAX = 16
"""Messages queued during a burst (see :meth:`Session.pump_sends`) after which they are
posted at once rather than all together later: the peer starts on these while the
rest are made, so the two ends work at the same time instead of taking turns."""
OPENING_MAX = 8
"""A burst of up to this many messages, or a larger one that all came from one socket
to one socket, has its first answer posted at once (see :meth:`Session.pump_sends`).
One conversation's two ends take turns unless the peer gets something to start on,
and so do both ends when a few messages are in flight; a larger burst from several
conversations comes while others are in flight, which keep both ends busy, and its
first answer alone only costs a write, a read and a handler run more at each end.
Measured (``rds stress``, 3 s runs, 2 each, against every first answer at once):
``-q 64 -a 16`` t=4 d=8 50.9-52.3k -> 55.5-58.5k tx/s, t=8 d=4 48.0-49.0k -> 51.2-53.2k,
t=2 d=16 54.1-54.5k -> 58.5-59.4k, ``-q 1024 -a 256`` t=4 d=8 47.8-48.7k -> 50.8-52.8k;
the same for t=1 d=4, t=1 d=16, t=2 d=4, t=4 d=2, t=1 d=4 -D 64K and t=1 d=1.
Holding every first answer instead made t=1 d=16 35-37k, against 44-48k."""
ACK_BACKSTOP = 10 * ACK_DELAY
"""Seconds after :data:`~rdmashim.ulps.rds.rdma_flow.ACK_DELAY` by which the session's
task sends an acknowledgement held back for a message of ours to carry when no reader
went back to waiting meanwhile. A reader that does (:meth:`Session.ack_needed`) brings
the timer back to ``ACK_DELAY``; a reader comes back after each message it answers, and
by then its answer carried the acknowledgement. So the task's timer is set once per
this many seconds, not once per ``ACK_DELAY``, and rarely fires for nothing: at one
request in flight it woke the task 0.17-0.44 times a message (2,000-450 a second), each
wake-up a pass of trio's run loop and about 30 Python calls."""
