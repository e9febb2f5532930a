"""A node's congestion maps: its own, sent to every peer, and those its peers send.

RDS's flow control between sockets (Linux's ``cong.c``): a socket holding more than
``settings.rcvbuf`` bytes unread marks its port congested in the node's 8 KiB map
(:class:`~rdmashim.ulps.rds.wire.CongestionMap`), and the map goes to every peer on
each change and at the start of every session (outside the sequence, the newest
only: :meth:`~rdmashim.ulps.rds.connection.RdsConnection.queue_map`). A peer's map
arrives on its connection; senders to a port it marks wait on the peer entry's
``uncongested`` event, and monitors (:meth:`NodeCongestion.monitor`) hear of every
change.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from rdmashim.ulps.rds.connection import IPAddress, RdsConnection
from rdmashim.ulps.rds.peer import Peer
from rdmashim.ulps.rds.wire import CongestionMap

log = logging.getLogger(__name__)

MONITOR_BACKLOG = 1024
"""Congestion changes a monitor may fall behind by; later ones are dropped for it."""

Change = tuple[str, set[int]]
"""A change of a peer's map: (the peer's address, the ports whose bit changed)."""


class NodeCongestion:
    """The node's own map and its peers' (see the module docstring). ``peers`` is the
    node's peer entries, by address (the table's own dict)."""

    def __init__(self, address: IPAddress, peers: dict[IPAddress, Peer]) -> None:
        self.address = address
        self.peers = peers
        self.ours = CongestionMap()
        """This node's ports whose sockets hold more than ``settings.rcvbuf`` bytes unread."""
        self._monitors: list[trio.MemorySendChannel[Change]] = []

    def mark(self, port: int, congested: bool) -> None:
        """Mark ``port`` congested or not; a change goes to every peer with a session."""
        if congested == self.ours.test(port):
            return
        if congested:
            self.ours.set(port)
        else:
            self.ours.clear(port)
        log.debug("RDS %s port %d %scongested", self.address, port, "" if congested else "un")
        for entry in self.peers.values():
            if entry.rds.session is not None:
                self.send_map(entry.rds)

    def send_map(self, rds: RdsConnection) -> None:
        """Queue our map on ``rds`` (and send it if a session is up)."""
        rds.queue_map(self.ours.encode())
        if rds.session is not None:
            rds.session.pump_sends()

    def peer_changed(self, rds: RdsConnection, ports: set[int]) -> None:
        """The connection's ``on_congestion``: the peer's map changed for ``ports``."""
        entry = self.peers.get(rds.peer)
        if entry is not None:
            entry.uncongested.set()
        for monitor in list(self._monitors):
            try:
                monitor.send_nowait((str(rds.peer), ports))
            except trio.WouldBlock:  # a peer flipping its map cannot fill our memory
                log.debug("congestion monitor %d changes behind: one dropped", MONITOR_BACKLOG)
            except trio.BrokenResourceError:
                self._monitors.remove(monitor)

    @asynccontextmanager
    async def monitor(self) -> AsyncIterator[trio.MemoryReceiveChannel[Change]]:
        """The changes of peers' maps, as (peer address, ports that changed); a monitor
        :data:`MONITOR_BACKLOG` changes behind misses the changes after those."""
        send, recv = trio.open_memory_channel[Change](MONITOR_BACKLOG)
        self._monitors.append(send)
        try:
            async with recv:
                yield recv
        finally:
            if send in self._monitors:
                self._monitors.remove(send)

    def of_peer(self, peer: str) -> CongestionMap:
        """The map the node at ``peer`` last sent (an empty one for an unknown peer)."""
        entry = self.peers.get(ipaddress.ip_address(peer))
        return entry.rds.peer_congestion if entry is not None else CongestionMap()
