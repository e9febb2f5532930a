"""The access layer's threads: calls marshalled to the progress thread, callbacks on their own."""

from __future__ import annotations

import threading

import pytest

from rdmashim.providers.ibal import IbError, IbStatus, ib_close_al, ib_open_al


def test_calls_run_on_the_progress_thread_and_callbacks_on_theirs() -> None:
    al = ib_open_al()
    try:
        where = al.run(threading.current_thread)
        assert where.name == "ibal-progress" and where is not threading.current_thread()
        seen: list[tuple[str, int]] = []
        done = threading.Event()

        def cb(n: int) -> None:
            seen.append((threading.current_thread().name, n))
            if n == 2:
                done.set()

        for n in range(3):
            al.callback(cb, n)
        assert done.wait(5)
        al.sync_callbacks()
        assert seen == [("ibal-callbacks", 0), ("ibal-callbacks", 1), ("ibal-callbacks", 2)]
    finally:
        ib_close_al(al)


def test_a_raising_callback_does_not_stop_the_others(caplog: pytest.LogCaptureFixture) -> None:
    al = ib_open_al()
    try:
        ran: list[int] = []

        def bad() -> None:
            raise RuntimeError("callback bug")

        al.callback(bad)
        al.callback(ran.append, 1)
        al.sync_callbacks()
        assert ran == [1]
        assert "callback bug" in caplog.text
    finally:
        ib_close_al(al)


def test_errors_in_a_call_become_statuses() -> None:
    al = ib_open_al()
    try:

        def fails() -> None:
            raise OSError(12, "no memory")

        with pytest.raises(IbError) as info:
            al.call("ib_alloc_pd", fails)
        assert info.value.status is IbStatus.IB_INSUFFICIENT_MEMORY
        assert str(info.value).startswith("ib_alloc_pd: IB_INSUFFICIENT_MEMORY")
    finally:
        ib_close_al(al)


def test_closed_al_refuses_calls_and_a_second_close() -> None:
    al = ib_open_al()
    ib_close_al(al)
    with pytest.raises(IbError) as info:
        al.run(lambda: None)
    assert info.value.status is IbStatus.IB_INVALID_AL_HANDLE
    with pytest.raises(IbError):
        ib_close_al(al)


def test_close_from_a_callback_is_refused() -> None:
    al = ib_open_al()
    try:
        errors: list[IbError] = []

        def closer() -> None:
            try:
                ib_close_al(al)
            except IbError as exc:
                errors.append(exc)

        al.callback(closer)
        al.sync_callbacks()
        assert [e.status for e in errors] == [IbStatus.IB_INVALID_STATE]
    finally:
        ib_close_al(al)


def test_an_al_cannot_sit_on_ibal() -> None:
    with pytest.raises(IbError) as info:
        ib_open_al("ibal")
    assert info.value.status is IbStatus.IB_INVALID_PARAMETER


def test_a_callback_never_runs_inside_the_call_that_raised_it() -> None:
    """The progress thread only queues callbacks: the caller's call returns first."""
    al = ib_open_al()
    try:
        returned = threading.Event()
        seen: list[tuple[bool, str]] = []

        def cb() -> None:  # inside the call it would wait in vain
            seen.append((returned.wait(2), threading.current_thread().name))

        def body() -> None:
            al.callback(cb)

        al.call("ib_rearm_cq", body)
        returned.set()
        al.sync_callbacks()
        assert seen == [(True, "ibal-callbacks")]
        assert al.run(lambda: al.on_progress_thread()) and not al.on_callback_thread()
    finally:
        ib_close_al(al)


async def test_a_trio_program_may_call_directly() -> None:
    """A thread running its own trio loop calls in (trio's from_thread would refuse)."""
    al = ib_open_al()
    try:
        assert al.run(lambda: 41 + 1) == 42

        async def answer() -> int:
            return 7

        assert al.run_async(answer) == 7
    finally:
        ib_close_al(al)
