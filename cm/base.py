"""What every backend's CM id shares: the state table's checks, the QP it owns, its settings.

:class:`CMIdBase` is the part of ``rdma_cm_id`` that does not depend on how a
backend connects. Each call checks the id's state against
:data:`~rdmashim.cm.states.TRANSITIONS` first (:meth:`~CMIdBase._require`), so a
call the state does not allow fails with the same
:class:`~rdmashim.cm.states.CMStateError` on every backend; the state then moves
only through the table (:meth:`~CMIdBase._move` for a call,
:meth:`~CMIdBase._report` for an event, which posts it too). ``create_qp`` and
``destroy_qp`` keep the id's QP (``rdma_create_qp``, ``rdma_destroy_qp``); the
backend makes the QP (:meth:`~CMIdBase._new_qp`). ``destroy`` is idempotent and
ends the id's background work; the backend releases the rest
(:meth:`~CMIdBase._teardown`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Generic, NamedTuple, Protocol, TypeVar, cast

import trio

from rdmashim.cm.states import Call, after
from rdmashim.cm.types import DEFAULT_MAX_PENDING, CMEventType, CMState, PortSpace, TransportOptions
from rdmashim.verbs import abc
from rdmashim.verbs.errors import NotSupported, VerbsError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from rdmashim.cm.abc import ChannelHost, CMId
    from rdmashim.cm.addressing import SockAddr
    from rdmashim.cm.types import ConnParam
    from rdmashim.verbs.attrs import QPCap

log = logging.getLogger(__name__)

DEFAULT_CONNECT_TIMEOUT = 10.0
"""Seconds an active id waits for an answer before UNREACHABLE."""


class QPArgs(NamedTuple):
    """What ``create_qp`` takes beside the PD, in the order of ``ibv_qp_init_attr``."""

    send_cq: abc.CQ
    recv_cq: abc.CQ
    cap: QPCap | None
    srq: abc.SRQ | None
    sq_sig_all: bool


class _Closing(Protocol):
    """A device context that calls its ``close_listeners`` when it closes."""

    close_listeners: list[Callable[[], None]]


_Ctx = TypeVar("_Ctx", bound=abc.Context)
_QP = TypeVar("_QP", bound=abc.Resource)


class CMIdBase(ABC, Generic[_Ctx, _QP]):
    """A CM id's state, addresses, settings and QP, on any backend (see the module
    docstring); ``_Ctx`` and ``_QP`` are the backend's context and QP types."""

    transport_options: ClassVar[frozenset[str]] = frozenset()
    """The :class:`TransportOptions` fields the backend honours; other non-default
    values are refused (``CMBackend.transport_options``)."""
    options_refused_because: ClassVar[str] = "this backend has no transport settings"
    """Why the backend refuses the others, in words."""

    def __init__(self, channel: ChannelHost, ps: PortSpace, user_context: object = None) -> None:
        self.channel = channel
        self.ps = PortSpace(ps)
        self.user_context = user_context
        self.context: _Ctx | None = None
        self.qp: _QP | None = None
        self.pd: abc.PD | None = None
        self.state = CMState.IDLE
        self.local_addr: SockAddr | None = None
        self.peer_addr: SockAddr | None = None
        self.connect_timeout = DEFAULT_CONNECT_TIMEOUT
        """Seconds an active id waits for an answer before UNREACHABLE."""
        self.max_pending = DEFAULT_MAX_PENDING
        """A listener's bound on connections not yet accepted or rejected."""
        self._options = TransportOptions()
        self._scopes: list[trio.CancelScope] = []
        self._watched: _Closing | None = None

    def __repr__(self) -> str:
        return (
            f"<{type(self).__module__.rsplit('.', 2)[-2]} CM id {self.state.name} "
            f"local={self.local_addr} peer={self.peer_addr}>"
        )

    # ------------------------------------------------------------------ settings
    @property
    def options(self) -> TransportOptions:
        """Transport settings this id asks for or accepts (a listener passes them on to
        the ids of its requests); fields the backend does not honour stay default."""
        return self._options

    @options.setter
    def options(self, value: TransportOptions) -> None:
        if not isinstance(value, TransportOptions):
            raise VerbsError(errno.EINVAL, "options", f"{value!r} is no TransportOptions")
        refused = value.non_default() - self.transport_options
        if refused:
            raise NotSupported(
                "options", f"{', '.join(sorted(refused))}: {self.options_refused_because}"
            )
        self._options = value

    @property
    def negotiated(self) -> TransportOptions | None:
        """What connection setup settled, where the backend can tell (else None)."""
        return None

    # ------------------------------------------------------------------ the table
    def _require(self, call: Call) -> None:
        """Refuse ``call`` (:class:`~rdmashim.cm.states.CMStateError`) unless the state
        allows it."""
        after(self.state, call)

    def _move(self, call: Call) -> None:
        """``call`` takes effect: the state moves as the table says."""
        self.state = after(self.state, call)

    def _report(
        self,
        kind: CMEventType,
        status: int = 0,
        *,
        private_data: bytes = b"",
        param: ConnParam | None = None,
        listen_id: CMId | None = None,
        detail: str = "",
    ) -> None:
        """The state moves as the table says for event ``kind``; then it is posted."""
        self.state = after(self.state, kind)
        self.channel.post(
            kind, self._as_cm_id(), status, private_data=private_data, param=param,
            listen_id=listen_id, detail=detail,
        )  # fmt: skip

    def _require_tcp(self, operation: str) -> None:
        if self.ps != PortSpace.TCP:
            raise NotSupported(operation, f"port space {self.ps.name}: only TCP ids connect here")

    def _require_qp(self, operation: str, why: str) -> None:
        """``why`` a connection needs the id's QP, unless it has one."""
        if self.qp is None:
            raise NotSupported(operation, f"{why} (create_qp first)")

    # ------------------------------------------------------------------ background work
    def _spawn(
        self, fn: Callable[..., Awaitable[None]], *args: object, failed: CMEventType | None = None
    ) -> None:
        """Run ``fn(*args)`` in the channel's nursery until the id is destroyed.

        No error of one id's work reaches the nursery (and so the application and the
        other ids): a failure the work does not report itself is logged, and reported
        as a ``failed`` event when given.
        """
        scope = trio.CancelScope()
        self._scopes.append(scope)

        async def run() -> None:
            try:
                with scope:
                    await fn(*args)
            except Exception as exc:
                log.exception("%s: %s failed", self, getattr(fn, "__name__", fn))
                if failed is not None and self.state is not CMState.DESTROYED:
                    self._report(failed, -errno.EIO, detail=f"internal error: {exc!r}")
            finally:
                self._scopes.remove(scope)

        self.channel.nursery.start_soon(run)

    def _watch_device(self, context: _Ctx) -> None:
        """Use ``context``, and report DEVICE_REMOVAL when it closes."""
        closing: _Closing = context  # type: ignore[assignment]
        closing.close_listeners.append(self._device_removed)
        self._watched = closing
        self.context = context

    def _device_removed(self) -> None:
        if self.state is not CMState.DESTROYED:
            self._report(CMEventType.DEVICE_REMOVAL, detail="device context closed")

    # ------------------------------------------------------------------ the QP
    def create_qp(
        self,
        pd: abc.PD,
        *,
        send_cq: abc.CQ,
        recv_cq: abc.CQ,
        cap: QPCap | None = None,
        srq: abc.SRQ | None = None,
        sq_sig_all: bool = False,
    ) -> _QP:
        """Create the id's QP on ``pd``, which must be on ``context`` (``rdma_create_qp``)."""
        self._require(Call.CREATE_QP)
        if self.qp is not None:
            raise VerbsError(errno.EEXIST, "create_qp", "the id already has a QP")
        self._check_pd(pd)
        qp = self._new_qp(pd, QPArgs(send_cq, recv_cq, cap, srq, sq_sig_all))
        self.pd, self.qp = pd, qp
        self._move(Call.CREATE_QP)
        return qp

    def _check_pd(self, pd: abc.PD) -> None:
        """EINVAL unless ``pd`` is on the id's device context."""
        if pd.context is not self.context:
            raise VerbsError(errno.EINVAL, "create_qp", "PD belongs to another device")

    @abstractmethod
    def _new_qp(self, pd: abc.PD, args: QPArgs) -> _QP:
        """The backend's QP for this id on ``pd`` (checked to be on ``context``)."""

    def destroy_qp(self) -> None:
        """Destroy the id's QP (``rdma_destroy_qp``); nothing if it has none. A connected
        (or connecting) id keeps it: disconnect first."""
        self._require(Call.DESTROY_QP)
        qp, self.qp = self.qp, None
        self._move(Call.DESTROY_QP)
        if qp is not None:
            qp.close()

    # ------------------------------------------------------------------ teardown
    def destroy(self) -> None:
        """Release the id (``rdma_destroy_id``); idempotent. A connection on it ends, a
        request on it is refused; no event of it follows."""
        if self.state is CMState.DESTROYED:
            return
        before = self.state
        self._move(Call.DESTROY)
        for scope in self._scopes:
            scope.cancel()
        if self._watched is not None:
            with contextlib.suppress(ValueError):
                self._watched.close_listeners.remove(self._device_removed)
        self._teardown(before)
        self.channel.forget(self._as_cm_id())

    def _as_cm_id(self) -> CMId:
        """This id as the channel knows it: every backend's id is a
        :class:`~rdmashim.cm.abc.CMId` (the backend makes the calls this base leaves to it)."""
        return cast("CMId", self)

    @abstractmethod
    def _teardown(self, before: CMState) -> None:
        """Release what the backend holds for the id, which was in state ``before``."""

    def join_multicast(self, addr: SockAddr, context: object = None) -> None:
        """Multicast needs UD QPs, which the portable API does not have."""
        raise NotSupported("join_multicast", "multicast needs UD QPs, which the API does not have")


__all__ = ["DEFAULT_CONNECT_TIMEOUT", "CMIdBase", "QPArgs"]
