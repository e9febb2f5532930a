"""MPA connection setup rules (RFC 5044 §7, RFC 6581) as Linux siw applies them."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rdmashim.providers.softiwarp.mpa import (
    IRD_ORD_MASK,
    MAX_PRIVATE_DATA,
    RTR,
    StartFrame,
    encode_start_frame,
    parse_start_frame,
)
from rdmashim.providers.softiwarp.negotiation import (
    MpaOptions,
    MpaRejected,
    MpaResult,
    answer_request,
    check_reply,
    make_request,
    reject_reply,
)
from rdmashim.providers.softiwarp.terminate import LlpCode, ProtocolError, TermCode, llp

SIW_REQUEST = b"MPA ID Req Frame" + bytes([0x10, 0x02, 0x00, 0x04]) + bytes([0, 1, 0, 1])
INVALID = llp(LlpCode.INVALID_REQ_REP)


def wire(frame: StartFrame) -> StartFrame:
    """``frame`` after a trip over the wire."""
    data = encode_start_frame(frame)
    result = parse_start_frame(data, reply=frame.reply)
    assert result is not None and result[1] == len(data)
    return result[0]


def connect(
    initiator: MpaOptions,
    responder: MpaOptions,
    request_pd: bytes = b"",
    reply_pd: bytes = b"",
) -> tuple[MpaResult, MpaResult]:
    """Both sides of an MPA exchange, frames going over the wire: (initiator, responder)."""
    request = make_request(initiator, request_pd)
    reply, responder_result = answer_request(wire(request), responder, reply_pd)
    return check_reply(request, wire(reply), initiator), responder_result


@contextlib.contextmanager
def raises_code(code: TermCode) -> Iterator[None]:
    """Expect a ProtocolError carrying Terminate code ``code``."""
    with pytest.raises(ProtocolError) as info:
        yield
    assert info.value.code == code


# ---------------------------------------------------------------------------------------
# make_request
# ---------------------------------------------------------------------------------------


def test_default_request() -> None:
    request = make_request(MpaOptions(), b"hi")
    assert request == StartFrame(
        reply=False, revision=2, crc=True, enhanced=True, ird=16, ord=16, private_data=b"hi"
    )


def test_siw_compatible_request_bytes() -> None:
    request = make_request(MpaOptions(crc=False, ird=1, ord=1), b"")
    assert encode_start_frame(request) == SIW_REQUEST


def test_rev1_request_has_no_v2_block() -> None:
    request = make_request(MpaOptions(revision=1, p2p=True, ird=8, ord=8), b"pd")
    assert request == StartFrame(
        reply=False, revision=1, crc=True, enhanced=False, private_data=b"pd"
    )
    assert encode_start_frame(request) == b"MPA ID Req Frame" + bytes([0x40, 1, 0, 2]) + b"pd"


def test_p2p_request_offers_rtr_types() -> None:
    request = make_request(MpaOptions(p2p=True, ird=1, ord=1, crc=False), b"")
    assert request.p2p and request.rtr == RTR.WRITE | RTR.READ
    assert encode_start_frame(request)[20:] == bytes([0x80, 1, 0xC0, 1])
    request = make_request(MpaOptions(p2p=True, rtr=RTR.READ), b"")
    assert encode_start_frame(request)[20:] == bytes([0x80, 16, 0x40, 16])
    # without P2P nothing is offered, whatever the options say
    assert make_request(MpaOptions(rtr=RTR.READ), b"").rtr == RTR.NONE


# ---------------------------------------------------------------------------------------
# CRC, markers, revisions
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("initiator_crc", [False, True])
@pytest.mark.parametrize("responder_crc", [False, True])
@pytest.mark.parametrize("revision", [1, 2])
def test_crc_on_when_either_side_asks(
    initiator_crc: bool, responder_crc: bool, revision: int
) -> None:
    request = make_request(MpaOptions(crc=initiator_crc, revision=revision), b"")
    reply, responder = answer_request(wire(request), MpaOptions(crc=responder_crc), b"")
    assert reply.crc == responder.crc == (initiator_crc or responder_crc)
    initiator = check_reply(request, wire(reply), MpaOptions(crc=initiator_crc))
    assert initiator.crc == responder.crc


def test_initiator_runs_crc_if_it_asked_even_if_reply_clears_it() -> None:
    request = make_request(MpaOptions(crc=True), b"")
    reply = StartFrame(reply=True, crc=False, ird=16, ord=16)
    assert check_reply(request, reply, MpaOptions(crc=True)).crc


def test_markers_requested_are_rejected() -> None:
    request = wire(dataclasses.replace(make_request(MpaOptions(), b""), markers=True))
    with raises_code(INVALID):
        answer_request(request, MpaOptions(), b"")
    reject = wire(reject_reply(request, b"no markers"))
    assert reject.reject and reject.revision == 2 and reject.private_data == b"no markers"
    with pytest.raises(MpaRejected) as info:
        check_reply(make_request(MpaOptions(), b""), reject, MpaOptions())
    assert info.value.private_data == b"no markers"


def test_markers_in_reply_are_refused() -> None:
    request = make_request(MpaOptions(), b"")
    reply = StartFrame(reply=True, markers=True, ird=16, ord=16)
    with raises_code(INVALID):
        check_reply(request, wire(reply), MpaOptions())


def test_rev1_request_accepted_and_answered_with_rev1() -> None:
    request = wire(make_request(MpaOptions(revision=1, crc=False), b"req"))
    reply, responder = answer_request(request, MpaOptions(crc=False, ird=7, ord=9), b"rep")
    assert reply == StartFrame(reply=True, revision=1, enhanced=False, private_data=b"rep")
    assert encode_start_frame(reply) == b"MPA ID Rep Frame" + bytes([0, 1, 0, 3]) + b"rep"
    assert responder == MpaResult(False, 1, 7, 9, RTR.NONE, b"req")
    initiator = check_reply(request, wire(reply), MpaOptions(revision=1, crc=False, ird=3, ord=4))
    assert initiator == MpaResult(False, 1, 3, 4, RTR.NONE, b"rep")


def test_rev1_request_from_siw_era_peer_bytes() -> None:
    # the old zrlio siw: rev 1, no flags, no private data
    data = b"MPA ID Req Frame" + bytes([0, 1, 0, 0])
    assert parse_start_frame(data, reply=False) == (
        StartFrame(reply=False, revision=1, enhanced=False),
        20,
    )
    request = wire(StartFrame(reply=False, revision=1, enhanced=False))
    reply, result = answer_request(request, MpaOptions(crc=False), b"")
    assert encode_start_frame(reply) == b"MPA ID Rep Frame" + bytes([0, 1, 0, 0])
    assert result.revision == 1


def test_reply_revision_above_request_is_refused() -> None:
    request = make_request(MpaOptions(revision=1), b"")
    reply = StartFrame(reply=True, revision=2, ird=1, ord=1)
    with raises_code(INVALID):
        check_reply(request, wire(reply), MpaOptions(revision=1))


def test_enhanced_request_needs_enhanced_rev2_reply() -> None:
    """Like Linux siw: a rev 2 Reply without the IRD/ORD block fails the connection."""
    request = make_request(MpaOptions(), b"")
    reply = StartFrame(reply=True, revision=2, enhanced=False)
    with raises_code(INVALID):
        check_reply(request, wire(reply), MpaOptions())


def test_rev1_reply_to_enhanced_request_runs_rev1() -> None:
    """RFC 6581: a responder without enhanced setup answers rev 1; we run rev 1 with it."""
    request = make_request(MpaOptions(ird=8, ord=4), b"")
    result = check_reply(
        request, wire(StartFrame(reply=True, revision=1, enhanced=False)), MpaOptions(ird=8, ord=4)
    )
    assert (result.revision, result.ird, result.ord, result.rtr) == (1, 8, 4, RTR.NONE)


# ---------------------------------------------------------------------------------------
# IRD / ORD
# ---------------------------------------------------------------------------------------


def test_responder_lowers_ird_and_ord() -> None:
    mine = MpaOptions(ird=8, ord=4)
    request = make_request(mine, b"")
    reply, responder = answer_request(wire(request), MpaOptions(ird=16, ord=16), b"")
    # responder IRD <= initiator ORD, responder ORD <= initiator IRD
    assert (reply.ird, reply.ord) == (4, 8)
    assert (responder.ird, responder.ord) == (4, 8)
    initiator = check_reply(request, wire(reply), mine)
    assert initiator.ord == 4 and initiator.ird == 8


def test_responder_keeps_its_own_lower_limits() -> None:
    initiator, responder = connect(MpaOptions(ird=100, ord=100), MpaOptions(ird=2, ord=3))
    assert (responder.ird, responder.ord) == (2, 3)
    assert initiator.ord == 2  # never more Reads in flight than the responder serves
    assert responder.ord <= initiator.ird


def test_zero_ird_ord() -> None:
    initiator, responder = connect(MpaOptions(ird=0, ord=0), MpaOptions())
    assert (responder.ird, responder.ord) == (0, 0)
    assert initiator.ord == 0


def test_reply_ord_above_our_ird_is_insufficient_ird() -> None:
    options = MpaOptions(ird=4, ord=4)
    request = make_request(options, b"")
    with raises_code(llp(LlpCode.INSUFFICIENT_IRD)):
        check_reply(request, wire(StartFrame(reply=True, ird=4, ord=5)), options)
    result = check_reply(request, wire(StartFrame(reply=True, ird=4, ord=4)), options)
    assert (result.ird, result.ord) == (4, 4)


def test_initiator_ord_limited_by_reply_ird() -> None:
    options = MpaOptions(ird=4, ord=10)
    request = make_request(options, b"")
    result = check_reply(request, wire(StartFrame(reply=True, ird=3, ord=1)), options)
    assert result.ord == 3
    result = check_reply(request, wire(StartFrame(reply=True, ird=IRD_ORD_MASK, ord=0)), options)
    assert result.ord == 10


# ---------------------------------------------------------------------------------------
# Peer-to-peer RTR
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offered", "chosen"),
    [
        (RTR.WRITE | RTR.READ, RTR.WRITE),
        (RTR.WRITE, RTR.WRITE),
        (RTR.READ, RTR.READ),
        (RTR.SEND | RTR.READ, RTR.READ),
        (RTR.SEND | RTR.WRITE | RTR.READ, RTR.WRITE),
    ],
)
def test_rtr_choice_prefers_write(offered: RTR, chosen: RTR) -> None:
    initiator_options = MpaOptions(p2p=True, rtr=offered)
    request = wire(make_request(initiator_options, b""))
    reply, responder = answer_request(request, MpaOptions(p2p=True), b"")
    assert reply.p2p and reply.rtr == chosen == responder.rtr
    data = encode_start_frame(reply)
    assert data[20] & 0x80  # P2P echoed in the IRD word
    assert data[22] & 0xC0 == (0x80 if chosen == RTR.WRITE else 0x40)
    initiator = check_reply(make_request(initiator_options, b""), wire(reply), initiator_options)
    assert initiator.rtr == chosen


@pytest.mark.parametrize("offered", [RTR.NONE, RTR.SEND])
def test_no_write_or_read_offered_is_no_matching_rtr(offered: RTR) -> None:
    """Like siw, the responder proposes a Write RTR; the initiator cannot send it."""
    options = MpaOptions(p2p=True, rtr=offered)
    request = make_request(options, b"")
    reply, responder = answer_request(wire(request), MpaOptions(p2p=True), b"")
    assert reply.rtr == RTR.WRITE == responder.rtr
    with raises_code(llp(LlpCode.NO_MATCHING_RTR)):
        check_reply(request, wire(reply), options)


@pytest.mark.parametrize(
    ("offered", "p2p", "chosen"),
    [
        (RTR.WRITE, True, RTR.READ),  # not offered
        (RTR.READ, True, RTR.WRITE),  # not offered
        (RTR.WRITE | RTR.READ, True, RTR.WRITE | RTR.READ),  # must pick one
        (RTR.WRITE | RTR.READ, True, RTR.SEND),  # not supported
        (RTR.WRITE | RTR.READ, True, RTR.NONE),  # P2P but nothing chosen
        (None, True, RTR.WRITE),  # P2P reply to a non-P2P request
    ],
)
def test_check_reply_no_matching_rtr(offered: RTR | None, p2p: bool, chosen: RTR) -> None:
    options = MpaOptions(p2p=offered is not None, rtr=offered or RTR.NONE)
    request = make_request(options, b"")
    reply = StartFrame(reply=True, ird=16, ord=16, p2p=p2p, rtr=chosen)
    with raises_code(llp(LlpCode.NO_MATCHING_RTR)):
        check_reply(request, wire(reply), options)


def test_p2p_only_when_both_sides_want_it() -> None:
    initiator, responder = connect(MpaOptions(p2p=True), MpaOptions(p2p=False))
    assert initiator.rtr == responder.rtr == RTR.NONE
    initiator, responder = connect(MpaOptions(p2p=False), MpaOptions(p2p=True))
    assert initiator.rtr == responder.rtr == RTR.NONE
    initiator, responder = connect(MpaOptions(p2p=True, revision=1), MpaOptions(p2p=True))
    assert initiator.rtr == responder.rtr == RTR.NONE


# ---------------------------------------------------------------------------------------
# Reject and private data
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("revision", [1, 2])
def test_reject_carries_private_data(revision: int) -> None:
    options = MpaOptions(revision=revision)
    request = make_request(options, b"let me in")
    reject = reject_reply(wire(request), b"not today")
    assert reject.reply and reject.reject and reject.revision == revision
    assert reject.enhanced == (revision == 2)
    with pytest.raises(MpaRejected) as info:
        check_reply(request, wire(reject), options)
    assert info.value.private_data == b"not today"
    assert "9 bytes" in str(info.value)


def test_reject_of_an_unparsable_request() -> None:
    reject = reject_reply(None, b"?")
    assert reject == StartFrame(
        reply=True, revision=2, reject=True, enhanced=True, private_data=b"?"
    )
    assert (
        encode_start_frame(reject)
        == b"MPA ID Rep Frame" + bytes([0x30, 2, 0, 5, 0, 0, 0, 0]) + b"?"
    )


def test_reject_wins_over_other_reply_errors() -> None:
    request = make_request(MpaOptions(), b"")
    reply = StartFrame(reply=True, reject=True, markers=True, enhanced=False, private_data=b"x")
    with pytest.raises(MpaRejected):
        check_reply(request, wire(reply), MpaOptions())


def test_private_data_exchanged() -> None:
    initiator, responder = connect(MpaOptions(), MpaOptions(), b"from initiator", b"from responder")
    assert responder.private_data == b"from initiator"
    assert initiator.private_data == b"from responder"


@pytest.mark.parametrize(("revision", "limit"), [(2, 252), (1, 256)])
def test_private_data_limits(revision: int, limit: int) -> None:
    """256 bytes in all, the 4-byte v2 IRD/ORD block included."""
    options = MpaOptions(revision=revision)
    request = make_request(options, bytes(limit))
    data = encode_start_frame(request)
    assert len(data) == 20 + MAX_PRIVATE_DATA
    with pytest.raises(ValueError):
        encode_start_frame(make_request(options, bytes(limit + 1)))
    reply, responder = answer_request(wire(request), MpaOptions(), b"r" * limit)
    assert len(encode_start_frame(reply)) == 20 + MAX_PRIVATE_DATA
    assert responder.private_data == bytes(limit)
    with pytest.raises(ValueError):
        encode_start_frame(answer_request(wire(request), MpaOptions(), bytes(limit + 1))[0])
    assert len(encode_start_frame(reject_reply(wire(request), bytes(limit)))) == 276
    with pytest.raises(ValueError):
        encode_start_frame(reject_reply(wire(request), bytes(limit + 1)))
    initiator = check_reply(request, wire(reply), options)
    assert initiator.private_data == b"r" * limit


# ---------------------------------------------------------------------------------------
# hypothesis: any two option sets agree
# ---------------------------------------------------------------------------------------

ird_ord = st.integers(0, IRD_ORD_MASK)
options = st.builds(
    MpaOptions,
    crc=st.booleans(),
    revision=st.sampled_from([1, 2]),
    p2p=st.booleans(),
    rtr=st.builds(RTR, st.integers(0, 7)),
    ird=ird_ord,
    ord=ird_ord,
)


@given(options, options, st.binary(max_size=252), st.binary(max_size=252))
@settings(max_examples=300)
def test_both_sides_agree(
    mine: MpaOptions, theirs: MpaOptions, request_pd: bytes, reply_pd: bytes
) -> None:
    request = make_request(mine, request_pd)
    assert wire(request) == request
    reply, responder = answer_request(wire(request), theirs, reply_pd)
    assert wire(reply) == reply
    assert reply.revision == request.revision == mine.revision
    p2p = mine.p2p and theirs.p2p and mine.revision == 2
    if p2p and not mine.rtr & (RTR.WRITE | RTR.READ):
        with raises_code(llp(LlpCode.NO_MATCHING_RTR)):
            check_reply(request, wire(reply), mine)
        return
    initiator = check_reply(request, wire(reply), mine)
    assert initiator.crc == responder.crc == (mine.crc or theirs.crc)
    assert initiator.revision == responder.revision == mine.revision
    assert initiator.rtr == responder.rtr
    if p2p:
        assert initiator.rtr == (RTR.WRITE if mine.rtr & RTR.WRITE else RTR.READ)
    else:
        assert initiator.rtr == RTR.NONE
    assert responder.private_data == request_pd and initiator.private_data == reply_pd
    # nobody issues more RDMA Reads than the other side serves, nor more than it asked for
    assert responder.ord <= theirs.ord and responder.ird <= theirs.ird
    assert initiator.ord <= mine.ord and initiator.ird <= mine.ird
    if mine.revision == 2:
        assert initiator.ord <= responder.ird
        assert responder.ord <= initiator.ird


@given(options, st.binary(max_size=256))
def test_reject_round_trip(mine: MpaOptions, pd: bytes) -> None:
    request = make_request(mine, b"")
    reject = reject_reply(wire(request), pd[: 256 - 4 * request.enhanced])
    with pytest.raises(MpaRejected) as info:
        check_reply(request, wire(reject), mine)
    assert info.value.private_data == reject.private_data
