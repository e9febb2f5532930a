"""The RDMAP/DDP protocol engine of one queue pair, free of I/O (sans-IO).

The engine turns posted work into FPDU bytes and received bytes into placed
data and completions. The trio driver (:mod:`.driver`) only moves bytes, and
this is all it and the verbs objects call:

* post: :meth:`Engine.post_send` queues a send job (or a run of them); receives
  are taken from the ``recv_queue`` the engine was given.
* transmit: :meth:`Engine.produce` returns the buffers of the next FPDUs
  (headers, slices of registered memory, trailers) for one gathering send;
  after sending them all the driver calls :meth:`Engine.sent`, which completes
  the Sends and Writes whose last byte went out. Nothing else reaches the socket.
* receive: :meth:`Engine.recv_buffer` names where the next received bytes go,
  either straight into the target slice of registered memory (direct placement
  of a large payload) or into the staging buffer; after ``recv_into`` the driver
  calls :meth:`Engine.received` with the byte count.
* the connection: :meth:`Engine.start` (RTS, with what MPA settled),
  :meth:`Engine.connection_lost`, :meth:`Engine.set_error`; and registered memory
  going away (:meth:`Engine.revoke`, through the memory table).
* out: each of these calls appends what it produced to :attr:`Engine.outbox`
  (:data:`~.jobs.Outcome`): completions in order, the completions of a run of
  small Sends or receives together, the P2P initiator's RTR arriving
  (:class:`~.jobs.Ready`), the QP failing (:class:`~.jobs.Failed`). The caller
  takes the outbox after the call; the engine calls nothing back.

A protocol violation by the peer, or a local error, queues a Terminate (RFC 5040
§5.3), moves the QP to ERROR and flushes all outstanding work; so does a
Terminate from the peer or the loss of the connection.

No time is passed in: once MPA has set the connection up, RDMAP and DDP over TCP
have no timers (TCP retransmits; Linux siw's only timers guard MPA setup). The two
timeouts there are belong to the I/O around the engine: MPA setup's
(:mod:`.connection`) and how long the driver waits for the peer's FIN after an
error (:data:`.driver.LINGER`).

The engine is split along the seams of Linux siw: :mod:`.qp_state` (the QP's
state, Terminate, flushes: ``siw_qp.c``), :mod:`.tx` (``siw_qp_tx.c``),
:mod:`.rx` and :mod:`.rx_runs` (``siw_qp_rx.c``), :mod:`.reads` (the ORQ and
IRQ); :mod:`.jobs` holds the work they carry. :class:`Engine` puts them together.
"""

from __future__ import annotations

from rdmashim.providers.softiwarp.rx import Receiver
from rdmashim.providers.softiwarp.tx import Transmitter


class Engine(Receiver, Transmitter):
    """The protocol engine of one RC queue pair (see the module docstring)."""
