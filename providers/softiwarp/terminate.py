"""iWARP Terminate error codes (RFC 5040 §4.8, RFC 5041 §7, RFC 5044 §8, RFC 6581 §9).

A :class:`TermCode` is the (layer, error type, error code) triple that a
Terminate message carries; :class:`ProtocolError` is the exception the engine
raises when the peer breaks the protocol, carrying the code to send back.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from rdmashim.verbs.errors import ProtocolViolation


class Layer(IntEnum):
    """The layer that detected the error."""

    RDMAP = 0
    DDP = 1
    LLP = 2


class RdmapType(IntEnum):
    """RDMAP error types."""

    CATASTROPHIC = 0
    REMOTE_PROTECTION = 1
    REMOTE_OPERATION = 2


class RdmapCode(IntEnum):
    """RDMAP error codes."""

    INVALID_STAG = 0x00
    BASE_BOUNDS = 0x01
    ACCESS_RIGHTS = 0x02
    STAG_NOT_ASSOC = 0x03
    TO_WRAP = 0x04
    VERSION = 0x05
    OPCODE = 0x06
    CATASTROPHIC_STREAM = 0x07
    CATASTROPHIC_GLOBAL = 0x08
    CANNOT_INVALIDATE = 0x09
    UNSPECIFIED = 0xFF


class DdpType(IntEnum):
    """DDP error types."""

    CATASTROPHIC = 0
    TAGGED = 1
    UNTAGGED = 2


class DdpTaggedCode(IntEnum):
    """DDP tagged buffer error codes."""

    INVALID_STAG = 0x00
    BASE_BOUNDS = 0x01
    STAG_NOT_ASSOC = 0x02
    TO_WRAP = 0x03
    VERSION = 0x04


class DdpUntaggedCode(IntEnum):
    """DDP untagged buffer error codes."""

    INVALID_QN = 0x01
    MSN_NO_BUFFER = 0x02
    MSN_RANGE = 0x03
    INVALID_MO = 0x04
    MSG_TOO_LONG = 0x05
    VERSION = 0x06


class LlpCode(IntEnum):
    """MPA (LLP layer, error type 0) error codes."""

    TCP_STREAM_LOST = 0x01
    CRC = 0x02
    FPDU_START = 0x03
    INVALID_REQ_REP = 0x04
    LOCAL_CATASTROPHIC = 0x05
    INSUFFICIENT_IRD = 0x06
    NO_MATCHING_RTR = 0x07


_CODE_TABLES: dict[tuple[int, int], type[IntEnum]] = {
    (Layer.RDMAP, RdmapType.CATASTROPHIC): RdmapCode,
    (Layer.RDMAP, RdmapType.REMOTE_PROTECTION): RdmapCode,
    (Layer.RDMAP, RdmapType.REMOTE_OPERATION): RdmapCode,
    (Layer.DDP, DdpType.TAGGED): DdpTaggedCode,
    (Layer.DDP, DdpType.UNTAGGED): DdpUntaggedCode,
    (Layer.LLP, 0): LlpCode,
}
_TYPE_TABLES: dict[int, type[IntEnum]] = {Layer.RDMAP: RdmapType, Layer.DDP: DdpType}


@dataclass(frozen=True, slots=True)
class TermCode:
    """The layer / error type / error code triple of a Terminate message."""

    layer: int
    etype: int
    ecode: int

    def __str__(self) -> str:
        try:
            layer = Layer(self.layer).name
        except ValueError:
            layer = f"layer {self.layer}"
        etype_table = _TYPE_TABLES.get(self.layer)
        etype: str = f"type {self.etype}"
        if etype_table is not None and self.etype in etype_table._value2member_map_:
            etype = etype_table(self.etype).name
        elif self.layer == Layer.LLP and self.etype == 0:
            etype = "MPA"
        code_table = _CODE_TABLES.get((self.layer, self.etype))
        ecode = f"code {self.ecode:#04x}"
        if code_table is not None and self.ecode in code_table._value2member_map_:
            ecode = code_table(self.ecode).name
        return f"{layer}/{etype}/{ecode}"

    @property
    def meaning(self) -> str:
        """What a peer that sends this code tells the side it ends, in a verbs
        programmer's words ("" when the code names nothing more specific than itself)."""
        if self.layer == Layer.RDMAP and self.etype == RdmapType.CATASTROPHIC:
            return _CATASTROPHIC_PEER
        return _MEANINGS.get((self.layer, self.etype, self.ecode), "")


def rdmap(etype: RdmapType, ecode: RdmapCode) -> TermCode:
    """An RDMAP-layer Terminate code."""
    return TermCode(Layer.RDMAP, etype, ecode)


def ddp_tagged(ecode: DdpTaggedCode) -> TermCode:
    """A DDP tagged-buffer Terminate code."""
    return TermCode(Layer.DDP, DdpType.TAGGED, ecode)


def ddp_untagged(ecode: DdpUntaggedCode) -> TermCode:
    """A DDP untagged-buffer Terminate code."""
    return TermCode(Layer.DDP, DdpType.UNTAGGED, ecode)


def llp(ecode: LlpCode) -> TermCode:
    """An MPA (LLP-layer) Terminate code."""
    return TermCode(Layer.LLP, 0, ecode)


_WRITE_STAG = (
    "the peer refused an RDMA Write (or a Read Response) to an rkey it does not take: the "
    "rkey is wrong, the peer closed that region, or registered it without REMOTE_WRITE"
)
_OTHER_PD = "the rkey names a region of another protection domain at the peer"
_MALFORMED = "the peer found a malformed message on the wire (a bug in one of the two engines)"
_CATASTROPHIC_PEER = (
    "the peer failed locally (it closed memory that work in progress used, or hit an error "
    "of its own)"
)
_CANNOT_INVALIDATE = "the peer could not invalidate the STag a Send with Invalidate named"
_MEANINGS: dict[tuple[int, int, int], str] = {
    (Layer.DDP, DdpType.TAGGED, DdpTaggedCode.INVALID_STAG): _WRITE_STAG,
    (Layer.DDP, DdpType.TAGGED, DdpTaggedCode.BASE_BOUNDS): (
        "an RDMA Write or Read Response fell outside the peer's region (check the remote "
        "address and the length)"
    ),
    (Layer.DDP, DdpType.TAGGED, DdpTaggedCode.STAG_NOT_ASSOC): _OTHER_PD,
    (Layer.DDP, DdpType.TAGGED, DdpTaggedCode.TO_WRAP): (
        "the remote address plus the length passes 2**64"
    ),
    (Layer.DDP, DdpType.UNTAGGED, DdpUntaggedCode.MSN_NO_BUFFER): (
        "a Send found no receive posted at the peer, or one too small for it (iWARP has no "
        "RNR retry: post receives, as large as the Sends, before the peer sends)"
    ),
    (Layer.DDP, DdpType.UNTAGGED, DdpUntaggedCode.MSG_TOO_LONG): (
        "a Send was longer than the receive the peer posted for it"
    ),
    (Layer.DDP, DdpType.UNTAGGED, DdpUntaggedCode.INVALID_QN): _MALFORMED,
    (Layer.DDP, DdpType.UNTAGGED, DdpUntaggedCode.MSN_RANGE): _MALFORMED,
    (Layer.DDP, DdpType.UNTAGGED, DdpUntaggedCode.INVALID_MO): _MALFORMED,
    (Layer.RDMAP, RdmapType.REMOTE_PROTECTION, RdmapCode.INVALID_STAG): (
        "the peer refused an RDMA Read from an rkey it does not take: the rkey is wrong or "
        "the peer closed that region"
    ),
    (Layer.RDMAP, RdmapType.REMOTE_PROTECTION, RdmapCode.ACCESS_RIGHTS): (
        "the peer's region was registered without REMOTE_READ"
    ),
    (Layer.RDMAP, RdmapType.REMOTE_PROTECTION, RdmapCode.BASE_BOUNDS): (
        "an RDMA Read fell outside the peer's region (check the remote address and the length)"
    ),
    (Layer.RDMAP, RdmapType.REMOTE_PROTECTION, RdmapCode.STAG_NOT_ASSOC): _OTHER_PD,
    (Layer.RDMAP, RdmapType.REMOTE_PROTECTION, RdmapCode.TO_WRAP): (
        "the remote address plus the length passes 2**64"
    ),
    (Layer.RDMAP, RdmapType.REMOTE_PROTECTION, RdmapCode.CANNOT_INVALIDATE): _CANNOT_INVALIDATE,
    (Layer.RDMAP, RdmapType.REMOTE_OPERATION, RdmapCode.CANNOT_INVALIDATE): _CANNOT_INVALIDATE,
    (Layer.RDMAP, RdmapType.REMOTE_OPERATION, RdmapCode.CATASTROPHIC_STREAM): (
        "more RDMA Reads were outstanding than the peer takes (its IRD: lower the ORD)"
    ),
    (Layer.LLP, 0, LlpCode.CRC): "bytes were corrupted on the way (a CRC mismatch)",
    (Layer.LLP, 0, LlpCode.INSUFFICIENT_IRD): (
        "the peer takes fewer outstanding RDMA Reads than this side asked for (IRD/ORD)"
    ),
}
"""What the common Terminate codes mean to the side they end."""

DDP_CATASTROPHIC = TermCode(Layer.DDP, DdpType.CATASTROPHIC, 0)
RDMAP_LOCAL_CATASTROPHIC = rdmap(RdmapType.CATASTROPHIC, RdmapCode.UNSPECIFIED)


class ProtocolError(ProtocolViolation):
    """The iWARP stream broke the protocol; ``code`` is what a Terminate reports.

    ``header`` is the offending FPDU's decoded header when known, which the
    Terminate quotes (as a DDP header, or as an RDMAP header when ``quote_rdmap``).
    """

    def __init__(
        self,
        message: str,
        code: TermCode = RDMAP_LOCAL_CATASTROPHIC,
        *,
        header: object = None,
        quote_rdmap: bool = False,
    ) -> None:
        super().__init__(f"{message} [{code}]")
        self.code = code
        self.header = header
        self.quote_rdmap = quote_rdmap
