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

"In any order" includes a reference cycle collected at once: Python clears the
weak references to the cycle's objects before it runs their finalizers, so a
parent finalized first (a CQ before its QP) cannot see its children, and its
C object is still in use (EBUSY). Such a parent is left *orphaned* and destroyed
right after its last child is.
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
    _orphaned = False  # collected while a child still used it: closed after the child

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
            if parent._orphaned and not parent._children:
                parent._orphaned = False
                parent._finalize()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if self._closed or sys.is_finalizing():
            return
        self._finalize()

    def _finalize(self) -> None:
        """Close a collected object, or leave it orphaned while a child uses it."""
        try:
            self.close()
        except VerbsError as exc:
            if exc.errno != errno.EBUSY:
                log.exception("destroying a collected %s failed", self._kind)
            else:
                log.debug("collected %s still in use: destroyed after its child", self._kind)
                self._orphaned = True
        except Exception:
            log.exception("destroying a collected %s failed", self._kind)
