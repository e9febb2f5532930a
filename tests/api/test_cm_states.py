"""Every CM id call in every state follows rdma_cm's one table (``rdmashim.cm.states``).

A real id is driven into each state by real calls against a real listener on
:data:`~api.support.HOST` (:data:`RECIPES`: a new id, one bound, resolving, ...,
connected from either side, disconnected, destroyed), then one call is made. It
must be refused with ``CMStateError`` exactly where the table has no entry, the
refusal naming the call and the state (in words and by name) and leaving the
state as it was. An allowed call must land in the table's next state; a call that
starts something (resolve_addr, resolve_route, connect, accept, disconnect) may
have been answered already, and once its event (ADDR_RESOLVED, ROUTE_RESOLVED,
ESTABLISHED, DISCONNECTED) arrives the id must be in the table's state after it.

``check`` takes an open event channel, so ``tests/test_cm_states.py`` runs the
same pairs on every backend of this machine.
"""

from __future__ import annotations

import errno
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from api.support import HOST, Cm, E

from rdmashim import QPCap
from rdmashim.cm import CMEventType, CMState, ConnParam, EventChannel
from rdmashim.cm.states import TRANSITIONS, WORDS, Call, CMStateError, allowed

S = CMState
CAP = QPCap(max_send_wr=4, max_recv_wr=4)


class Kit:
    """What the calls need: the listener's port and a PD and CQ on the device the route to
    :data:`HOST` picks (the device every id of the test uses)."""

    def __init__(self, cm: Cm, helper: Any) -> None:
        self.cm = cm
        self.port = cm.listen()
        self.pd = helper.context.alloc_pd()
        self.cq = helper.context.create_cq(64)

    @classmethod
    async def make(cls, cm: Cm) -> Kit:
        return cls(cm, await cm.resolve(cm.listen()))

    def qp(self, cm_id: Any) -> Any:
        return cm_id.create_qp(self.pd, send_cq=self.cq, recv_cq=self.cq, cap=CAP)


CALLS: dict[Call, Callable[[Any, Kit], object]] = {
    Call.BIND_ADDR: lambda cm_id, kit: cm_id.bind_addr((HOST, 0)),
    Call.RESOLVE_ADDR: lambda cm_id, kit: cm_id.resolve_addr(None, (HOST, kit.port)),
    Call.RESOLVE_ROUTE: lambda cm_id, kit: cm_id.resolve_route(),
    Call.CREATE_QP: lambda cm_id, kit: kit.qp(cm_id),
    Call.DESTROY_QP: lambda cm_id, kit: cm_id.destroy_qp(),
    Call.CONNECT: lambda cm_id, kit: cm_id.connect(ConnParam()),
    Call.LISTEN: lambda cm_id, kit: cm_id.listen(),
    Call.ACCEPT: lambda cm_id, kit: cm_id.accept(ConnParam()),
    Call.REJECT: lambda cm_id, kit: cm_id.reject(b""),
    Call.DISCONNECT: lambda cm_id, kit: cm_id.disconnect(),
    Call.DESTROY: lambda cm_id, kit: cm_id.destroy(),
}
"""Each call, with arguments that are right wherever the state allows the call."""

Drive = Callable[[Kit], Awaitable[Any]]
"""A way to an id in some state: returns the id."""


async def _new(kit: Kit) -> Any:
    return kit.cm.channel.create_id()


def _then(drive: Drive, *calls: Call) -> Drive:
    """``drive``, then ``calls`` on the id (no waiting after the last)."""

    async def then(kit: Kit) -> Any:
        cm_id = await drive(kit)
        for call in calls:
            CALLS[call](cm_id, kit)
        return cm_id

    return then


def _until(drive: Drive, kind: CMEventType) -> Drive:
    """``drive``, then wait for the id's event ``kind``."""

    async def until(kit: Kit) -> Any:
        cm_id = await drive(kit)
        await kit.cm.events.expect(cm_id, kind)
        return cm_id

    return until


_resolving_address = _then(_new, Call.RESOLVE_ADDR)
_resolving_route = _then(_until(_resolving_address, E.ADDR_RESOLVED), Call.RESOLVE_ROUTE)
_route_resolved = _until(_resolving_route, E.ROUTE_RESOLVED)
_connecting = _then(_route_resolved, Call.CREATE_QP, Call.CONNECT)


async def _request(kit: Kit) -> Any:
    """The new id of a request: an active id connects to the listener."""
    await _connecting(kit)
    return (await kit.cm.events.request()).id


def _pair(side: int, disconnected: bool) -> Drive:
    """One id (0: active, 1: passive) of a connection both ends saw ESTABLISHED; with
    ``disconnected``, both then saw DISCONNECTED after the active end disconnected."""

    async def pair(kit: Kit) -> Any:
        active = await _connecting(kit)
        passive = (await kit.cm.events.request()).id
        kit.qp(passive)
        passive.accept(ConnParam())
        ends = (active, passive)
        for end in ends:
            await kit.cm.events.expect(end, E.ESTABLISHED)
        if disconnected:
            active.disconnect()
            for end in ends:
                await kit.cm.events.expect(end, E.DISCONNECTED)
        return ends[side]

    return pair


@dataclass(frozen=True)
class Recipe:
    """A way to a state: ``drive`` returns the id, in ``state``, with a QP or not."""

    name: str
    state: CMState
    has_qp: bool
    drive: Drive


RECIPES = [
    Recipe("new", S.IDLE, False, _new),
    Recipe("bound", S.ADDR_BOUND, False, _then(_new, Call.BIND_ADDR)),
    Recipe("resolving-address", S.ADDR_QUERY, False, _resolving_address),
    Recipe("address-resolved", S.ADDR_RESOLVED, False, _until(_resolving_address, E.ADDR_RESOLVED)),
    Recipe("resolving-route", S.ROUTE_QUERY, False, _resolving_route),
    Recipe("route-resolved", S.ROUTE_RESOLVED, False, _route_resolved),
    Recipe("route-resolved-qp", S.ROUTE_RESOLVED, True, _then(_route_resolved, Call.CREATE_QP)),
    Recipe("connecting", S.CONNECT, True, _connecting),
    Recipe("listening", S.LISTEN, False, _then(_new, Call.BIND_ADDR, Call.LISTEN)),
    Recipe("request", S.CONNECT_REQUEST, False, _request),
    Recipe("request-qp", S.CONNECT_REQUEST, True, _then(_request, Call.CREATE_QP)),
    Recipe("accepting", S.ACCEPTING, True, _then(_request, Call.CREATE_QP, Call.ACCEPT)),
    Recipe("connected-active", S.ESTABLISHED, True, _pair(0, disconnected=False)),
    Recipe("connected-passive", S.ESTABLISHED, True, _pair(1, disconnected=False)),
    Recipe("disconnected-itself", S.DISCONNECTED, True, _pair(0, disconnected=True)),
    Recipe("disconnected-by-peer", S.DISCONNECTED, True, _pair(1, disconnected=True)),
    Recipe("rejected", S.DISCONNECTED, False, _then(_request, Call.REJECT)),
    Recipe("destroyed", S.DESTROYED, False, _then(_new, Call.DESTROY)),
]
"""18 ways into the 13 states, each by the calls (and events) an application meets."""

OUTCOME: dict[Call, CMEventType] = {
    Call.RESOLVE_ADDR: E.ADDR_RESOLVED,
    Call.RESOLVE_ROUTE: E.ROUTE_RESOLVED,
    Call.CONNECT: E.ESTABLISHED,
    Call.ACCEPT: E.ESTABLISHED,
    Call.DISCONNECT: E.DISCONNECTED,
}
"""The event that reports how a call that starts something ended, here."""

NEEDS_QP = (Call.CONNECT, Call.ACCEPT)
"""Calls made where allowed only on ids with a QP (iWARP connects a QP; without one, IB
would answer CONNECT_RESPONSE); create_qp is made where allowed only on ids without."""


def _makes_sense(recipe: Recipe, call: Call) -> bool:
    if not allowed(recipe.state, call):
        return True
    if call in NEEDS_QP:
        return recipe.has_qp
    return call is not Call.CREATE_QP or not recipe.has_qp


PAIRS = [
    pytest.param(recipe, call, id=f"{recipe.name}-{call.value}")
    for recipe in RECIPES
    for call in Call
    if _makes_sense(recipe, call)
]


async def _outcome(kit: Kit, cm_id: Any, call: Call) -> CMEventType:
    """The next event of ``cm_id`` after ``call`` but TIMEWAIT_EXIT (a connection closing
    before the call), answering the request a connect makes at the listener."""
    if call is Call.CONNECT:
        passive = (await kit.cm.events.request()).id
        kit.qp(passive)
        passive.accept(ConnParam())
    event = await kit.cm.events.next(cm_id)
    while event.event is E.TIMEWAIT_EXIT:
        event = await kit.cm.events.next(cm_id)
    return event.event


async def check(channel: EventChannel, recipe: Recipe, call: Call) -> None:
    """Drive an id by ``recipe``, make ``call``, and hold the outcome to the table."""
    kit = await Kit.make(Cm(channel))
    cm_id = await recipe.drive(kit)
    state = cm_id.state
    where = f"{call.value} on a {recipe.name} id"
    assert state is recipe.state, f"{recipe.name}: the id is {state.name}, not {recipe.state.name}"
    try:
        CALLS[call](cm_id, kit)
    except OSError as exc:
        refused: OSError | None = exc
    else:
        refused = None
    if not allowed(state, call):
        assert refused is not None, f"{where}: allowed (now {cm_id.state.name}), the table refuses"
        assert isinstance(refused, CMStateError), f"{where}: refused with {refused!r}"
        assert refused.errno == (errno.EBADF if state is S.DESTROYED else errno.EINVAL)
        assert refused.operation == call.value, refused
        assert f"{WORDS[state]} ({state.name})" in str(refused) or state is S.DESTROYED, refused
        assert "destroyed" in str(refused) or state is not S.DESTROYED, refused
        assert cm_id.state is state, f"{where}: refused, but the id moved to {cm_id.state.name}"
        return
    assert refused is None, f"{where}: refused ({refused!r}), the table allows it"
    then = TRANSITIONS[(state, call)]
    kind = OUTCOME.get(call)
    settled = TRANSITIONS.get((then, kind)) if kind is not None else None
    assert cm_id.state in (then, settled), f"{where}: {cm_id.state.name}, not {then.name}"
    if kind is not None and settled is not None:
        got = await _outcome(kit, cm_id, call)
        assert got is kind, f"{where}: {got.name} came, not {kind.name}"
        assert cm_id.state is settled, f"{where}: {cm_id.state.name} after {kind.name}"


@pytest.mark.parametrize(("recipe", "call"), PAIRS)
async def test_every_call_in_every_state(cm: Cm, recipe: Recipe, call: Call) -> None:
    await check(cm.channel, recipe, call)
