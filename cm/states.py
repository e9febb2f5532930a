"""A CM id's states and what moves it between them: one table every backend follows.

:data:`TRANSITIONS` maps (state, what happens) to the state that follows. What
happens is a call of the application (:class:`Call`) or an event the id
reports (:class:`~rdmashim.cm.types.CMEventType`). A call with no entry for the
id's state is refused, on every backend alike, with :class:`CMStateError`
(:func:`refusal` words it). An event with no entry leaves the state as it is
(DEVICE_REMOVAL, TIMEWAIT_EXIT, an answer that comes after the id moved on).

A call that starts something (``resolve_addr``, ``resolve_route``, ``connect``,
``accept``, ``disconnect``) moves the id at once to the state its entry names
(ADDR_QUERY, ..., or no change), and the event that reports the outcome moves it
on: ADDR_QUERY --ADDR_RESOLVED--> ADDR_RESOLVED, or --ADDR_ERROR--> ADDR_BOUND.

The states are librdmacm's (the kernel's ``enum rdma_cm_state``: IDLE,
ADDR_QUERY, ADDR_RESOLVED, ROUTE_QUERY, ROUTE_RESOLVED, CONNECT, ADDR_BOUND,
LISTEN), with the kernel's CONNECT told apart as the application sees it
(CONNECT: an active id waiting for its answer; CONNECT_REQUEST: a request not
answered yet; ACCEPTING; ESTABLISHED), its DISCONNECT as DISCONNECTED and its
DESTROYING as DESTROYED. As in the kernel, a failed address resolution leaves
the id bound (``rdma_resolve_addr`` binds an idle id first) and ``listen`` binds
an idle id to the wildcard address.
"""

from __future__ import annotations

import errno
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING

from rdmashim.cm.types import CMEventType, CMState
from rdmashim.verbs.errors import VerbsError

if TYPE_CHECKING:
    from collections.abc import Mapping


class Call(Enum):
    """The calls of a CM id whose use depends on its state (``rdma_*``)."""

    BIND_ADDR = "bind_addr"
    RESOLVE_ADDR = "resolve_addr"
    RESOLVE_ROUTE = "resolve_route"
    CREATE_QP = "create_qp"
    DESTROY_QP = "destroy_qp"
    CONNECT = "connect"
    LISTEN = "listen"
    ACCEPT = "accept"
    REJECT = "reject"
    DISCONNECT = "disconnect"
    DESTROY = "destroy"


S = CMState
E = CMEventType

WORDS: Mapping[CMState, str] = MappingProxyType({
    S.IDLE: "new",
    S.ADDR_BOUND: "bound to a local address",
    S.ADDR_QUERY: "resolving an address",
    S.ADDR_RESOLVED: "resolved to a peer's address",
    S.ROUTE_QUERY: "resolving the route",
    S.ROUTE_RESOLVED: "resolved to a route",
    S.CONNECT: "connecting",
    S.LISTEN: "listening",
    S.CONNECT_REQUEST: "a connection request not yet answered",
    S.ACCEPTING: "accepting",
    S.ESTABLISHED: "connected",
    S.DISCONNECTED: "disconnected",
    S.DESTROYED: "destroyed",
})  # fmt: skip
"""Each state in the words of "the CM id is ..."."""

_WITH_DEVICE = (S.ADDR_RESOLVED, S.ROUTE_QUERY, S.ROUTE_RESOLVED, S.CONNECT_REQUEST)
"""States in which the id has its device and no connection yet: a QP may be made."""
_WITHOUT_CONNECTION = tuple(
    s for s in CMState if s not in (S.CONNECT, S.ACCEPTING, S.ESTABLISHED, S.DESTROYED)
)
"""States in which the id's QP (if any) carries no connection: it may be destroyed."""

TRANSITIONS: Mapping[tuple[CMState, Call | CMEventType], CMState] = MappingProxyType({
    # addresses and routes
    (S.IDLE, Call.BIND_ADDR): S.ADDR_BOUND,
    (S.IDLE, Call.RESOLVE_ADDR): S.ADDR_QUERY,
    (S.ADDR_BOUND, Call.RESOLVE_ADDR): S.ADDR_QUERY,
    (S.ADDR_QUERY, E.ADDR_RESOLVED): S.ADDR_RESOLVED,
    (S.ADDR_QUERY, E.ADDR_ERROR): S.ADDR_BOUND,
    (S.ADDR_RESOLVED, Call.RESOLVE_ROUTE): S.ROUTE_QUERY,
    (S.ROUTE_QUERY, E.ROUTE_RESOLVED): S.ROUTE_RESOLVED,
    (S.ROUTE_QUERY, E.ROUTE_ERROR): S.ADDR_RESOLVED,
    # the QP
    **{(s, Call.CREATE_QP): s for s in _WITH_DEVICE},
    **{(s, Call.DESTROY_QP): s for s in _WITHOUT_CONNECTION},
    # the active side
    (S.ROUTE_RESOLVED, Call.CONNECT): S.CONNECT,
    (S.CONNECT, E.ESTABLISHED): S.ESTABLISHED,
    (S.CONNECT, E.CONNECT_RESPONSE): S.ESTABLISHED,  # IB, an id without a QP (rdma-core)
    (S.CONNECT, E.REJECTED): S.ROUTE_RESOLVED,
    (S.CONNECT, E.UNREACHABLE): S.ROUTE_RESOLVED,
    (S.CONNECT, E.CONNECT_ERROR): S.ROUTE_RESOLVED,
    # the passive side: a request arrives on a new id, made IDLE by the listener
    (S.IDLE, Call.LISTEN): S.LISTEN,
    (S.ADDR_BOUND, Call.LISTEN): S.LISTEN,
    (S.IDLE, E.CONNECT_REQUEST): S.CONNECT_REQUEST,
    (S.CONNECT_REQUEST, Call.ACCEPT): S.ACCEPTING,
    (S.CONNECT_REQUEST, Call.REJECT): S.DISCONNECTED,
    (S.ACCEPTING, E.ESTABLISHED): S.ESTABLISHED,
    (S.ACCEPTING, E.REJECTED): S.DISCONNECTED,
    (S.ACCEPTING, E.UNREACHABLE): S.DISCONNECTED,
    (S.ACCEPTING, E.CONNECT_ERROR): S.DISCONNECTED,
    # the end
    (S.ACCEPTING, Call.DISCONNECT): S.ACCEPTING,
    (S.ESTABLISHED, Call.DISCONNECT): S.ESTABLISHED,
    (S.DISCONNECTED, Call.DISCONNECT): S.DISCONNECTED,
    (S.ACCEPTING, E.DISCONNECTED): S.DISCONNECTED,
    (S.ESTABLISHED, E.DISCONNECTED): S.DISCONNECTED,
    **{(s, Call.DESTROY): S.DESTROYED for s in CMState},
})  # fmt: skip
"""(state, call or event) -> the next state; a call not listed is refused."""


class CMStateError(VerbsError):
    """A CM id call its state does not allow (``operation`` names the call): EINVAL, or
    EBADF once the id is destroyed. The message says the state and what the call needs,
    in words and by name."""


def allowed(state: CMState, call: Call) -> bool:
    """Whether ``call`` is allowed in ``state``."""
    return (state, call) in TRANSITIONS


def needs(call: Call) -> tuple[CMState, ...]:
    """The states that allow ``call``, in the order of :class:`CMState`."""
    return tuple(s for s in CMState if (s, call) in TRANSITIONS)


def refusal(state: CMState, call: Call) -> CMStateError:
    """The error for ``call`` in ``state``, where the table does not allow it."""
    if state is S.DESTROYED:
        return CMStateError(errno.EBADF, call.value, "the CM id is destroyed")
    wanted = [f"{WORDS[s]} ({s.name})" for s in needs(call)]
    either = ", ".join(wanted[:-1]) + " or " + wanted[-1] if len(wanted) > 1 else wanted[0]
    return CMStateError(
        errno.EINVAL,
        call.value,
        f"the CM id is {WORDS[state]} ({state.name}); {call.value} needs one that is {either}",
    )


def after(state: CMState, happened: Call | CMEventType) -> CMState:
    """The state after ``happened`` in ``state``: the table's entry, or ``state`` for an
    event without one. A call without one is refused (:func:`refusal`)."""
    if isinstance(happened, Call) and not allowed(state, happened):
        raise refusal(state, happened)
    return TRANSITIONS.get((state, happened), state)


__all__ = ["TRANSITIONS", "WORDS", "CMStateError", "Call", "after", "allowed", "needs", "refusal"]
