"""The access layer: ``ib_open_al``/``ib_close_al``, its two threads, and handle lifetimes.

IBAL is a synchronous C API whose results come back through callbacks run "in
a system thread" (event, destroy and CM callbacks) or the provider's deferred
procedure context (CQ completions), never inside the caller's own call. The
facade keeps that model with two threads per open access layer:

* the **progress thread** runs a private trio loop that owns the HCA contexts
  (the portable devices the AL sits on) and everything under them. Every
  ``ib_*`` call is marshalled onto it (:meth:`IbAl.call`), so calls are
  thread-safe and may come from any thread: a plain program's main thread, a
  callback, or a trio program (each call is short; it never waits for the
  network).
* the **callback thread** runs the callbacks one at a time, in the order they
  were raised (:meth:`IbAl.callback`). A callback may call any ``ib_*``
  function, including the destroy calls, but must not call ``ib_close_al``
  or wait for another callback.

``ib_sync_destroy`` passed as a destroy callback makes a destroy call wait until
the callbacks raised before it have run, as IBAL's ``ib_sync_destroy`` does.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final, TypeVar

import outcome
import trio

from rdmashim.providers.ibal.status import IbError, IbStatus, status_from_errno

log = logging.getLogger(__name__)

T = TypeVar("T")

HCA_ENV_VAR = "RDMASHIM_IBAL_HCA"
"""The portable backend the access layer's CAs sit on when ``ib_open_al`` is not told."""
DEFAULT_HCA_BACKEND = "softiwarp"


class _SyncDestroy:
    """The type of :data:`ib_sync_destroy`."""

    def __repr__(self) -> str:
        return "ib_sync_destroy"


ib_sync_destroy: Final = _SyncDestroy()
"""Pass as a destroy callback to make the destroy call wait for outstanding callbacks."""

DestroyCallback = Callable[[Any], None] | _SyncDestroy | None
"""What a destroy call takes: a callback given the object's context, ib_sync_destroy, or None."""


class IbAl:
    """An open access layer (``ib_al_handle_t``): see the module docstring.

    ``hca_backend`` is the portable backend whose devices are this AL's CAs.
    """

    def __init__(self, hca_backend: str) -> None:
        self.hca_backend = hca_backend
        self.nursery: trio.Nursery | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._callbacks: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._children: list[Handle] = []
        self._closed = False
        self._progress = threading.Thread(
            target=self._progress_main, name="ibal-progress", daemon=True
        )
        self._callback_thread = threading.Thread(
            target=self._callback_main, name="ibal-callbacks", daemon=True
        )

    # ------------------------------------------------------------------ threads
    def _start(self) -> None:
        self._progress.start()
        self._ready.wait()
        if self._failure is not None:
            raise IbError(IbStatus.IB_ERROR, "ib_open_al", str(self._failure))
        self._callback_thread.start()

    def _progress_main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # the loop died: callers must not wait forever
            log.exception("ibal progress thread failed")
            self._failure = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _callback_main(self) -> None:
        while True:
            item = self._callbacks.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:
                log.exception("ibal callback %r raised", fn)

    def on_progress_thread(self) -> bool:
        """Whether the calling thread is the progress thread."""
        return threading.current_thread() is self._progress

    def on_callback_thread(self) -> bool:
        """Whether the calling thread is the callback thread (inside a callback)."""
        return threading.current_thread() is self._callback_thread

    # ------------------------------------------------------------------ marshalling
    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the progress thread and return its result (or raise its error).

        Works from any thread, a trio program's included (the call blocks that
        thread's loop for as long as the short call takes).
        """
        if self.on_progress_thread():
            return fn(*args)

        def begin(settle: Callable[[outcome.Outcome[T]], None]) -> None:
            settle(outcome.capture(fn, *args))

        return self._wait_for(begin)

    def run_async(self, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await afn(*args)`` on the progress thread's loop and return its result."""

        def begin(settle: Callable[[outcome.Outcome[T]], None]) -> None:
            async def task() -> None:
                settle(await outcome.acapture(afn, *args))

            assert self.nursery is not None
            self.nursery.start_soon(task)

        return self._wait_for(begin)

    def _wait_for(self, begin: Callable[[Callable[[outcome.Outcome[T]], None]], None]) -> T:
        """Have ``begin(settle)`` run on the progress loop; wait for its ``settle(result)``.

        Trio's ``from_thread`` refuses a thread that runs a trio loop of its own,
        so the hand-over is a plain ``run_sync_soon`` and a thread event.
        """
        if self._token is None or self._closed:
            raise IbError(IbStatus.IB_INVALID_AL_HANDLE, "ib_*", "the access layer is closed")
        done = threading.Event()
        result: list[outcome.Outcome[T]] = []

        def settle(value: outcome.Outcome[T]) -> None:
            result.append(value)
            done.set()

        def start() -> None:
            try:
                begin(settle)
            except BaseException as exc:  # report to the caller, never to the loop
                settle(outcome.Error(exc))

        try:
            self._token.run_sync_soon(start)
        except trio.RunFinishedError:
            raise IbError(
                IbStatus.IB_INVALID_AL_HANDLE, "ib_*", "the access layer is closed"
            ) from None
        done.wait()
        return result[0].unwrap()

    def call(self, name: str, fn: Callable[..., T], *args: Any) -> T:
        """Run an ``ib_*`` call's body on the progress thread, its OS errors as :class:`IbError`.

        A verbs error with errno E becomes ``IbError(status_from_errno(E), name)``;
        an :class:`IbError` raised by the body passes through unchanged.
        """
        with as_status(name):
            return self.run(fn, *args)

    def call_async(self, name: str, afn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """:meth:`call` for a body that awaits (``ib_open_ca`` opening a device)."""
        with as_status(name):
            return self.run_async(afn, *args)

    def spawn(self, afn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start a task in the progress thread's nursery (call on the progress thread)."""
        assert self.nursery is not None and self.on_progress_thread()
        self.nursery.start_soon(afn, *args)

    def callback(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` for the callback thread (from any thread)."""
        self._callbacks.put((fn, args))

    def sync_callbacks(self) -> None:
        """Wait until every callback queued before this call has run.

        Inside a callback it returns at once: the callbacks before the running
        one have run, and waiting for later ones would deadlock.
        """
        if self.on_callback_thread() or not self._callback_thread.is_alive():
            return
        done = threading.Event()
        self.callback(done.set)
        done.wait()

    # ------------------------------------------------------------------ lifetime
    def _adopt(self, child: Handle) -> None:
        self._children.append(child)

    def _disown(self, child: Handle) -> None:
        if child in self._children:
            self._children.remove(child)

    def close(self) -> None:
        """``ib_close_al``: destroy every object opened through this AL, then stop its threads."""
        if self._closed:
            raise IbError(IbStatus.IB_INVALID_AL_HANDLE, "ib_close_al", "already closed")
        if self.on_callback_thread():
            raise IbError(
                IbStatus.IB_INVALID_STATE, "ib_close_al", "may not be called from a callback"
            )
        self.run(self._release_children)
        self._closed = True
        self.sync_callbacks()
        self._callbacks.put(None)
        self._callback_thread.join()
        if self._token is not None and self._stop is not None:
            self._token.run_sync_soon(self._stop.set)
        self._progress.join()

    def _release_children(self) -> None:
        for child in reversed(list(self._children)):
            child._release()


@contextmanager
def as_status(name: str) -> Iterator[None]:
    """Let :class:`IbError` through; turn any other ``OSError`` into one for call ``name``."""
    try:
        yield
    except IbError:
        raise
    except OSError as exc:
        raise IbError(status_from_errno(exc.errno), name, str(exc)) from exc


class Handle:
    """The base of every IBAL handle: its AL, user context, parent and children.

    Destroying a handle destroys its children first (as IBAL's object tree does);
    a destroyed handle's calls fail with the handle kind's ``invalid`` status.
    All state changes happen on the progress thread.
    """

    invalid: IbStatus = IbStatus.IB_INVALID_HANDLE
    """The status a call on this handle returns once it is destroyed."""
    release_late = False
    """Whether a parent being destroyed releases this after its other children."""

    def __init__(self, al: IbAl, parent: Handle | None, context: Any) -> None:
        self.al = al
        self.context = context
        self.user_context = context
        """The context given at creation, passed to the object's callbacks (a CA's
        ``.context`` is its portable device context instead)."""
        self._parent = parent
        self._children: list[Handle] = []
        self.destroyed = False
        if parent is None:
            al._adopt(self)
        else:
            parent._children.append(self)

    def check(self, call: str) -> None:
        """Raise ``self.invalid`` for ``call`` if the handle is destroyed."""
        if self.destroyed or self.al._closed:
            raise IbError(self.invalid, call, f"{type(self).__name__} is destroyed")

    def _release(self) -> None:
        """Destroy the children, then this object's portable resources (progress thread)."""
        if self.destroyed:
            return
        newest_first = list(reversed(self._children))
        # CQs and SRQs go after the QPs that use them
        for child in [c for c in newest_first if not c.release_late] + [
            c for c in newest_first if c.release_late
        ]:
            child._release()
        self.destroyed = True
        if self._parent is None:
            self.al._disown(self)
        elif self in self._parent._children:
            self._parent._children.remove(self)
        self._close_resources()

    def _close_resources(self) -> None:
        """Close what this handle holds; subclasses override."""

    def destroy(self, call: str, pfn_destroy_cb: DestroyCallback) -> None:
        """The body of every ``ib_destroy_*``/``ib_close_*``/``ib_dealloc_*``/``ib_dereg_*``.

        The object is gone when the call returns; ``pfn_destroy_cb`` (given the
        object's context) then runs on the callback thread after every callback
        the object raised earlier. With :data:`ib_sync_destroy` the call itself
        waits for those callbacks instead.
        """
        self.check(call)
        self.al.call(call, self._release)
        if isinstance(pfn_destroy_cb, _SyncDestroy):
            self.al.sync_callbacks()
        elif pfn_destroy_cb is not None:
            self.al.callback(pfn_destroy_cb, self.user_context)


def ib_open_al(hca_backend: str | None = None) -> IbAl:
    """Open an access layer (``ib_open_al``); returns its handle.

    Its CAs are the devices of the portable backend ``hca_backend``, else of
    ``RDMASHIM_IBAL_HCA``, else of the built-in engine.
    """
    backend = hca_backend or os.environ.get(HCA_ENV_VAR) or DEFAULT_HCA_BACKEND
    if backend == "ibal":
        raise IbError(IbStatus.IB_INVALID_PARAMETER, "ib_open_al", "an AL cannot sit on ibal")
    al = IbAl(backend)
    al._start()
    return al


def ib_close_al(h_al: IbAl) -> None:
    """Close an access layer and everything opened through it (``ib_close_al``)."""
    h_al.close()
