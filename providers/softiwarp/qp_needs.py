"""What a queue pair asks of the objects around it: its engine (the Python one or the
native one), its protection domain and its device context, as protocols. The
provider's ``PD`` and ``Context`` import the QP module (:mod:`.qp`), so a QP names
them only so."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from rdmashim.verbs import abc

if TYPE_CHECKING:
    from collections.abc import Iterator

    import trio

    from rdmashim.providers.softiwarp.jobs import EngineConfig
    from rdmashim.providers.softiwarp.memory import MemoryTable
    from rdmashim.providers.softiwarp.terminate import TermCode


class QPContext(abc.Context, Protocol):
    """What a QP asks of its device context (the provider's ``Context``, which imports
    this module: a QP names it only so)."""

    @property
    def _closed(self) -> bool: ...

    @property
    def memory(self) -> MemoryTable: ...

    @property
    def nursery(self) -> trio.Nursery: ...

    @property
    def _qp_numbers(self) -> Iterator[int]: ...

    def _after_receive(self) -> None: ...


class QPDomain(abc.PD, Protocol):
    """What a QP asks of its protection domain (the provider's ``PD``)."""

    @property
    def context(self) -> QPContext: ...


class EngineView(Protocol):
    """What a QP's verbs object asks of its engine, the Python one or the native one."""

    error: Exception | None
    remote_terminate: TermCode | None
    config: EngineConfig

    def set_error(self, exc: Exception | None = None) -> None: ...
