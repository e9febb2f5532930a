"""Lifetime of the backend's objects: children hold their parents, parents close children.

Every object wraps a C object that depends on others (a QP on its PD, CQs and
SRQ; a CQ on its context and completion channel). A child keeps strong
references to what it depends on, so those stay alive as long as it does, in
any order of garbage collection. A parent knows its children only weakly and
closes the live ones before destroying itself, so closing a context (or a
collected PD) never leaves a C object pointing at freed memory. ``close()`` is
idempotent; a closed object refuses use with EBADF. Objects collected without
``close()`` are destroyed by their finalizer, which logs failures instead of
raising.
"""

from __future__ import annotations

import errno
import logging
import sys
import weakref
from typing import Self

from rdmashim.verbs.errors import VerbsError

log = logging.getLogger(__name__)


class Resource:
    """A C object with parents it depends on and children that depend on it."""

    _kind = "resource"
    _closed = True  # until __init__ has created the C object

    def __init__(self, *parents: Resource | None) -> None:
        """Check the parents are open; the subclass then creates its C object and calls
        :meth:`_created`."""
        self._parents = tuple(p for p in parents if p is not None)
        for parent in self._parents:
            parent._check_open(f"create {self._kind}")
        self._children: weakref.WeakSet[Resource] = weakref.WeakSet()

    def _created(self) -> None:
        """The C object exists: register with the parents and accept calls."""
        for parent in self._parents:
            parent._children.add(self)
        self._closed = False

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise VerbsError(errno.EBADF, operation, f"{self._kind} is closed")

    @property
    def closed(self) -> bool:
        """Whether close() has run."""
        return self._closed

    def _destroy(self) -> None:
        """Destroy the C object (children are gone already)."""
        raise NotImplementedError

    def close(self) -> None:
        """Close everything created from this object, then destroy it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            for child in list(self._children):
                child.close()
            self._destroy()
        except BaseException:
            self._closed = False
            raise
        for parent in self._parents:
            parent._children.discard(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self._closed or sys.is_finalizing():
            return
        try:
            self.close()
        except Exception:
            log.exception("destroying a collected %s failed", self._kind)
