"""The IB CM state machine without I/O: every transition, wrong-state calls, races, MRA, limits."""

from __future__ import annotations

import errno
from collections.abc import Callable

import pytest

from rdmashim.providers.ibal import IbError, IbStatus
from rdmashim.providers.ibal.cm_state import (
    IWARP_CARRIES,
    PDATA_SIZE,
    CmMachine,
    CmMsg,
    CmState,
    Notify,
    Send,
    Wire,
    ib_rej_status_t,
    rej_status_for,
    timeout_seconds,
)

S = CmState
R = ib_rej_status_t


def active_in(state: CmState) -> CmMachine:
    """An active machine driven to ``state`` through its own calls and events."""
    m = CmMachine(passive=False)
    steps: dict[CmState, list[Callable[[CmMachine], object]]] = {
        S.IDLE: [],
        S.REQ_SENT: [lambda m: m.req(b"")],
        S.REP_RCVD: [lambda m: m.req(b""), lambda m: m.established(b"")],
        S.MRA_REP_SENT: [lambda m: m.req(b""), lambda m: m.established(), lambda m: m.mra(b"", 3)],
        S.ESTABLISHED: [lambda m: m.req(b""), lambda m: m.established(), lambda m: m.rtu(b"")],
    }
    for step in steps[state]:
        step(m)
    assert m.state is state
    return m


def passive_in(state: CmState) -> CmMachine:
    m = CmMachine(passive=True)
    steps: dict[CmState, list[Callable[[CmMachine], object]]] = {
        S.REQ_RCVD: [],
        S.MRA_REQ_SENT: [lambda m: m.mra(b"", 5)],
        S.REP_SENT: [lambda m: m.rep(b"")],
        S.ESTABLISHED: [lambda m: m.rep(b""), lambda m: m.established()],
        S.DREQ_RCVD: [lambda m: m.rep(b""), lambda m: m.established(), lambda m: m.disconnected()],
        S.DREQ_SENT: [lambda m: m.rep(b""), lambda m: m.established(), lambda m: m.dreq(b"")],
    }
    for step in steps[state]:
        step(m)
    assert m.state is state
    return m


def test_active_req_rep_rtu_dreq_drep() -> None:
    m = CmMachine(passive=False)
    assert m.req(b"hello") == [Send(Wire.CONNECT, b"hello")]
    assert m.state is S.REQ_SENT
    assert m.established(b"welcome") == [Notify(CmMsg.REP, b"welcome")]
    assert m.state is S.REP_RCVD
    assert m.rtu(b"") == [] and m.state is S.ESTABLISHED
    assert m.dreq(b"") == [Send(Wire.DISCONNECT)] and m.state is S.DREQ_SENT
    assert m.disconnected() == [Notify(CmMsg.DREP)]
    assert m.state is S.TIMEWAIT and m.finished
    assert m.disconnected() == [] and m.established() == []


def test_passive_req_rep_rtu_then_the_peer_disconnects() -> None:
    m = CmMachine(passive=True)
    assert m.state is S.REQ_RCVD
    assert m.rep(b"ok") == [Send(Wire.ACCEPT, b"ok")] and m.state is S.REP_SENT
    assert m.established() == [Notify(CmMsg.RTU)] and m.state is S.ESTABLISHED
    assert m.disconnected() == [Notify(CmMsg.DREQ)] and m.state is S.DREQ_RCVD
    assert m.drep(b"") == [] and m.state is S.TIMEWAIT


def test_passive_rej_sends_a_reject_with_private_data() -> None:
    m = passive_in(S.REQ_RCVD)
    assert m.rej(b"go away") == [Send(Wire.REJECT, b"go away")]
    assert m.state is S.REJECTED and m.finished
    assert m.established() == [] and m.disconnected() == []


def test_active_rej_of_a_rep_disconnects() -> None:
    m = active_in(S.REP_RCVD)
    assert m.rej(b"") == [Send(Wire.DISCONNECT)] and m.state is S.REJECTED
    assert m.disconnected() == []  # the REJ ended it: no DREQ callback follows


def test_rejected_before_rep_is_the_rej_callback() -> None:
    m = active_in(S.REQ_SENT)
    assert m.rejected(R.IB_REJ_USER_DEFINED, b"no") == [
        Notify(CmMsg.REJ, b"no", R.IB_REJ_USER_DEFINED)
    ]
    assert m.state is S.REJECTED
    assert m.rejected(R.IB_REJ_TIMEOUT) == []


def test_a_failed_rep_is_the_passive_rej_callback() -> None:
    m = passive_in(S.REP_SENT)
    assert m.rejected(R.IB_REJ_TIMEOUT) == [Notify(CmMsg.REJ, b"", R.IB_REJ_TIMEOUT)]


@pytest.mark.parametrize("make", [lambda: active_in(S.REP_RCVD), lambda: passive_in(S.REP_SENT)])
def test_a_connection_lost_before_it_is_established_here_is_a_rej(
    make: Callable[[], CmMachine],
) -> None:
    m = make()
    assert m.disconnected() == [Notify(CmMsg.REJ, b"", R.IB_REJ_TIMEOUT)]


def test_dreq_race_ends_both_sides_with_drep() -> None:
    a, p = active_in(S.ESTABLISHED), passive_in(S.ESTABLISHED)
    a.dreq(b"")
    p.dreq(b"")
    assert a.disconnected() == [Notify(CmMsg.DREP)] and p.disconnected() == [Notify(CmMsg.DREP)]
    assert a.state is p.state is S.TIMEWAIT


def test_rej_race_with_the_peers_dreq() -> None:
    """The active side refuses the REP while the passive side disconnects: no more callbacks."""
    a, p = active_in(S.REP_RCVD), passive_in(S.ESTABLISHED)
    a.rej(b"")
    p.dreq(b"")
    assert a.disconnected() == []
    assert p.disconnected() == [Notify(CmMsg.DREP)]


def test_mra_on_req_then_rep_or_rej() -> None:
    m = passive_in(S.REQ_RCVD)
    assert m.mra(b"", 17) == [] and m.state is S.MRA_REQ_SENT and m.svc_timeout == 17
    with pytest.raises(IbError) as info:
        m.mra(b"", 17)
    assert info.value.status is IbStatus.IB_INVALID_STATE
    assert m.rep(b"") == [Send(Wire.ACCEPT, b"")]
    m2 = passive_in(S.MRA_REQ_SENT)
    assert m2.rej(b"x") == [Send(Wire.REJECT, b"x")]


def test_mra_on_rep_then_rtu_or_rej() -> None:
    m = active_in(S.MRA_REP_SENT)
    assert m.rtu(b"") == [] and m.state is S.ESTABLISHED
    m2 = active_in(S.MRA_REP_SENT)
    assert m2.rej(b"") == [Send(Wire.DISCONNECT)]


CALLS: dict[str, Callable[[CmMachine], object]] = {
    "req": lambda m: m.req(b""),
    "rep": lambda m: m.rep(b""),
    "rtu": lambda m: m.rtu(b""),
    "rej": lambda m: m.rej(b""),
    "mra": lambda m: m.mra(b"", 1),
    "dreq": lambda m: m.dreq(b""),
    "drep": lambda m: m.drep(b""),
}
ALLOWED: dict[str, set[CmState]] = {
    "req": {S.IDLE},
    "rep": {S.REQ_RCVD, S.MRA_REQ_SENT},
    "rtu": {S.REP_RCVD, S.MRA_REP_SENT},
    "rej": {S.REQ_RCVD, S.MRA_REQ_SENT, S.REP_RCVD, S.MRA_REP_SENT},
    "mra": {S.REQ_RCVD, S.REP_RCVD},
    "dreq": {S.ESTABLISHED},
    "drep": {S.DREQ_RCVD},
}
MACHINES: dict[str, Callable[[], CmMachine]] = {
    "active IDLE": lambda: active_in(S.IDLE),
    "active REQ_SENT": lambda: active_in(S.REQ_SENT),
    "active REP_RCVD": lambda: active_in(S.REP_RCVD),
    "active MRA_REP_SENT": lambda: active_in(S.MRA_REP_SENT),
    "active ESTABLISHED": lambda: active_in(S.ESTABLISHED),
    "passive REQ_RCVD": lambda: passive_in(S.REQ_RCVD),
    "passive MRA_REQ_SENT": lambda: passive_in(S.MRA_REQ_SENT),
    "passive REP_SENT": lambda: passive_in(S.REP_SENT),
    "passive ESTABLISHED": lambda: passive_in(S.ESTABLISHED),
    "passive DREQ_RCVD": lambda: passive_in(S.DREQ_RCVD),
    "passive DREQ_SENT": lambda: passive_in(S.DREQ_SENT),
}


@pytest.mark.parametrize("call", sorted(CALLS))
@pytest.mark.parametrize("where", sorted(MACHINES))
def test_every_call_in_every_state(call: str, where: str) -> None:
    m = MACHINES[where]()
    before = m.state
    if before in ALLOWED[call]:
        CALLS[call](m)
        assert m.state is not before
    else:
        with pytest.raises(IbError) as info:
            CALLS[call](m)
        assert info.value.status is IbStatus.IB_INVALID_STATE
        assert info.value.call == f"ib_cm_{call}"
        assert m.state is before


@pytest.mark.parametrize("call", sorted(CALLS))
def test_no_call_after_destroy(call: str) -> None:
    m = passive_in(S.ESTABLISHED)
    m.destroyed()
    assert m.disconnected() == [] and m.finished
    with pytest.raises(IbError) as info:
        CALLS[call](m)
    assert info.value.status is IbStatus.IB_INVALID_STATE


def test_ibal_private_data_limits() -> None:
    assert PDATA_SIZE == {
        CmMsg.REQ: 92, CmMsg.REP: 196, CmMsg.REJ: 148, CmMsg.RTU: 224,
        CmMsg.MRA: 222, CmMsg.DREQ: 220, CmMsg.DREP: 224,
    }  # fmt: skip
    everything = frozenset(CmMsg)
    cases: list[tuple[Callable[[CmMachine, bytes], object], Callable[[], CmMachine], CmMsg]] = [
        (lambda m, d: m.req(d), lambda: CmMachine(passive=False, carries=everything), CmMsg.REQ),
        (lambda m, d: m.rep(d), lambda: CmMachine(passive=True, carries=everything), CmMsg.REP),
        (lambda m, d: m.rej(d), lambda: CmMachine(passive=True, carries=everything), CmMsg.REJ),
        (lambda m, d: m.mra(d, 1), lambda: CmMachine(passive=True, carries=everything), CmMsg.MRA),
    ]
    for call, make, msg in cases:
        call(make(), bytes(PDATA_SIZE[msg]))  # exactly the limit is fine
        m = make()
        with pytest.raises(IbError) as info:
            call(m, bytes(PDATA_SIZE[msg] + 1))
        assert info.value.status is IbStatus.IB_INVALID_SETTING
        assert m.state in (S.IDLE, S.REQ_RCVD)  # a refused call changes nothing


@pytest.mark.parametrize(
    ("where", "call"),
    [
        ("active REP_RCVD", lambda m, d: m.rtu(d)),
        ("passive REQ_RCVD", lambda m, d: m.mra(d, 1)),
        ("passive ESTABLISHED", lambda m, d: m.dreq(d)),
        ("passive DREQ_RCVD", lambda m, d: m.drep(d)),
        ("active REP_RCVD", lambda m, d: m.rej(d)),
    ],
)
def test_private_data_iwarp_cannot_carry_is_refused(
    where: str, call: Callable[[CmMachine, bytes], object]
) -> None:
    m = MACHINES[where]()
    before = m.state
    with pytest.raises(IbError) as info:
        call(m, b"x")
    assert info.value.status is IbStatus.IB_UNSUPPORTED
    assert m.state is before
    call(m, b"")  # without private data the same call is fine


def test_iwarp_carries_req_rep_rej_and_no_ari() -> None:
    assert frozenset({CmMsg.REQ, CmMsg.REP, CmMsg.REJ}) == IWARP_CARRIES
    m = passive_in(S.REQ_RCVD)
    with pytest.raises(IbError) as info:
        m.rej(b"", ari=b"\1")
    assert info.value.status is IbStatus.IB_UNSUPPORTED
    with pytest.raises(IbError) as info:
        m.rej(b"", ari=bytes(73))
    assert info.value.status is IbStatus.IB_INVALID_SETTING


def test_rej_status_mapping() -> None:
    assert rej_status_for(True, -errno.ECONNREFUSED, b"") is R.IB_REJ_INVALID_SID
    assert rej_status_for(True, -errno.ECONNREFUSED, b"why") is R.IB_REJ_USER_DEFINED
    assert rej_status_for(True, -errno.ECONNRESET, b"") is R.IB_REJ_USER_DEFINED
    assert rej_status_for(False, -errno.ETIMEDOUT, b"") is R.IB_REJ_TIMEOUT
    assert rej_status_for(False, -errno.EHOSTUNREACH, b"") is R.IB_REJ_TIMEOUT
    assert rej_status_for(False, -errno.ECONNREFUSED, b"") is R.IB_REJ_INVALID_SID


def test_rej_status_values_are_ib_types_h() -> None:
    assert R.IB_REJ_TIMEOUT == 4 and R.IB_REJ_INVALID_SID == 8
    assert R.IB_REJ_STALE_CONN == 10 and R.IB_REJ_USER_DEFINED == 28
    assert R.IB_REJ_INVALID_MTU == 26 and R.IB_REJ_SERVICE_HANDOFF == 0xFFFF


def test_timeouts_are_4_096_us_powers_over_retries() -> None:
    assert timeout_seconds(0) == pytest.approx(4.096e-6)
    assert timeout_seconds(20, 1) == pytest.approx(2 * 4.096e-6 * 2**20)
