"""rds-info over our RDS: :func:`format_info` of this process's nodes, and the query of
another node's (:func:`query_info` asks, :func:`serve_info` answers)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields

import trio

from rdmashim.rdstools.common import RdsToolError, bind_any, serve_answers
from rdmashim.rdstools.defaults import ALL_TABLES, INFO_PORT, INFO_TABLES
from rdmashim.ulps.rds.connection import Counters
from rdmashim.ulps.rds.node import RdsError, RdsNode
from rdmashim.ulps.rds.tcp import TcpSession
from rdmashim.ulps.rds.wire import RDS_MAX_MSG_SIZE

log = logging.getLogger(__name__)

_INFO_REQUEST = b"rds-info:"


def _counter_rows(nodes: Sequence[RdsNode]) -> list[tuple[str, int]]:
    rows = {f.name: 0 for f in fields(Counters)}
    for node in nodes:
        for rds in node.connections():
            for f in fields(rds.counters):
                rows[f.name] += getattr(rds.counters, f.name)
    rows["drops_no_socket"] = sum(n.drops_no_socket for n in nodes)
    rows["loopback_messages"] = sum(n.loopback_messages for n in nodes)
    return list(rows.items())


def _check_tables(tables: str) -> None:
    for letter in tables:
        if letter not in INFO_TABLES:
            raise ValueError(f"no rds-info table {letter!r} (have {ALL_TABLES})")


def format_info(nodes: RdsNode | Iterable[RdsNode], tables: str = ALL_TABLES) -> str:
    """rds-info's tables (letters of :data:`INFO_TABLES`) for nodes of this process.

    Columns are rds-info's, with these differences: the sockets table's last
    column is the bytes queued unread (``Unread``) instead of an inode; ``Tos``
    is always 0. Counters are summed over
    the nodes' connections; ``drops_no_socket`` and ``loopback_messages`` are
    the nodes' own.
    """
    all_nodes = [nodes] if isinstance(nodes, RdsNode) else list(nodes)
    out: list[str] = []
    _check_tables(tables)
    for letter in tables:
        if letter == "c":
            out.append(f"\nCounters:\n{'CounterName':>25} {'Value':>16}")
            out += [f"{name:>25} {value:>16}" for name, value in _counter_rows(all_nodes)]
        elif letter == "k":
            out.append(
                f"\nRDS Sockets:\n{'BoundAddr':>15} {'BPort':>5} {'ConnAddr':>15} {'CPort':>5} "
                f"{'SndBuf':>10} {'RcvBuf':>10} {'Unread':>8}"
            )
            for node in all_nodes:
                bufs = f"{node.settings.sndbuf:>10} {node.settings.rcvbuf:>10}"
                for sock in node.sockets():
                    out.append(
                        f"{node.address!s:>15} {sock.port:>5} {'0.0.0.0':>15} {0:>5} "
                        f"{bufs} {sock.queued_bytes:>8}"
                    )
        elif letter == "n":
            out.append(
                f"\nRDS Connections:\n{'LocalAddr':>15} {'RemoteAddr':>15} {'Tos':>4} "
                f"{'NextTX':>16} {'NextRX':>16} {'Flgs':>4}"
            )
            for node in all_nodes:
                for rds in node.connections():
                    out.append(
                        f"{rds.local!s:>15} {rds.peer!s:>15} {0:>4} {rds.next_seq:>16} "
                        f"{rds.next_recv:>16} {node.connection_flags(str(rds.peer))}"
                    )
        elif letter == "T":
            out.append(
                f"\nTCP Connections:\n{'LocalAddr':>15} {'LPort':>5} {'RemoteAddr':>15} "
                f"{'RPort':>5} {'HdrRemain':>10} {'DataRemain':>10} {'SentNxt':>12} "
                f"{'ExpectUna':>12} {'SeenUna':>12}"
            )
            for node in all_nodes:
                for rds in node.connections():
                    if isinstance(rds.session, TcpSession) and not rds.session.lost:
                        la, lp, ra, rp, hdr, data, nxt, una, seen = rds.session.info()
                        out.append(
                            f"{la:>15} {lp:>5} {ra:>15} {rp:>5} {hdr:>10} {data:>10} "
                            f"{nxt:>12} {una:>12} {seen:>12}"
                        )
        else:
            name = {"r": "Receive", "s": "Send", "t": "Retransmit"}[letter]
            out.append(
                f"\n{name} Message Queue:\n{'LocalAddr':>15} {'LPort':>5} {'RemoteAddr':>15} "
                f"{'RPort':>5} {'Tos':>4} {'Seq':>16} {'Bytes':>10}"
            )
            for node in all_nodes:
                out += [
                    f"{local:>15} {lport:>5} {remote:>15} {rport:>5} {0:>4} {seq:>16} {size:>10}"
                    for local, lport, remote, rport, seq, size in _queued(node, letter)
                ]
    return "\n".join(out).lstrip("\n") + "\n"


def _queued(node: RdsNode, letter: str) -> Iterator[tuple[str, int, str, int, int, int]]:
    """(local, lport, remote, rport, seq, bytes) of the messages in a queue of rds-info."""
    if letter == "r":
        for sock in node.sockets():
            for msg in list(sock.received):
                yield str(node.address), sock.port, *msg.sender, msg.seq, len(msg.data)
        return
    for rds in node.connections():
        for out in list(rds.unsent if letter == "s" else rds.unacked):
            yield str(rds.local), out.sport, str(rds.peer), out.dport, out.seq, len(out.data)


async def serve_info(
    node: RdsNode,
    port: int = INFO_PORT,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer :func:`query_info` requests with :func:`format_info` of ``node``."""

    def info(data: bytes, sender: tuple[str, int]) -> bytes | None:
        if not data.startswith(_INFO_REQUEST):
            log.info("not an rds-info request from %s:%d", *sender)
            return None
        tables = data[len(_INFO_REQUEST) :].decode("ascii", "replace") or ALL_TABLES
        try:
            text = format_info(node, tables)
        except ValueError as exc:
            text = f"error: {exc}\n"
        return text.encode()[:RDS_MAX_MSG_SIZE]

    await serve_answers(node, port, info, task_status)


async def query_info(
    node: RdsNode,
    dest: str,
    tables: str = ALL_TABLES,
    *,
    port: int = INFO_PORT,
    within: float = 5.0,
) -> str:
    """Ask the node at ``dest`` (running :func:`serve_info`) for its rds-info tables."""
    _check_tables(tables)
    sock = bind_any(node)
    try:
        with trio.move_on_after(within):
            await sock.sendto(_INFO_REQUEST + tables.encode(), (dest, port))
            data, _ = await sock.recvfrom()
            return data.decode("utf-8", "replace")
        raise RdsToolError(
            f"no rds-info answer from {dest} (RDS port {port}) within {within:g} s: "
            "only nodes run by `rdmashim rds ping --serve` or `rdmashim rds stress` "
            "(or calling rdmashim.rdstools.info.serve_info) answer"
        )
    except RdsError as exc:
        raise RdsToolError(f"rds-info query to {dest}: {exc}") from exc
    finally:
        sock.close()
