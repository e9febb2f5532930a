"""What every verbs object of the built-in engine shares: ``Resource`` (open or
closed, usable as a context manager, leaving its parent when closed) and
``Parent`` (a resource whose close closes its children first)."""

from __future__ import annotations

import errno
from typing import Self, TypeVar

from rdmashim.verbs.errors import (
    VerbsError,
)


class Resource:
    """Closing is idempotent; a closed resource refuses use and leaves its parent."""

    _closed = False
    _kind = "resource"
    _parent: Parent | None = None

    def _check_open(self, operation: str) -> None:
        if self._closed:
            raise VerbsError(errno.EBADF, operation, f"{self._kind} is closed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _leave_parent(self) -> None:
        """Mark closed and let the parent forget this resource (nothing else holds it)."""
        self._closed = True
        if self._parent is not None:
            self._parent._children.pop(id(self), None)
            self._parent = None

    def close(self) -> None:  # pragma: no cover - overridden
        self._leave_parent()


R = TypeVar("R", bound=Resource)


class Parent(Resource):
    """A resource that closes the resources created from it when it closes."""

    def __init__(self) -> None:
        self._children: dict[int, Resource] = {}

    def _adopt(self, child: R) -> R:
        child._parent = self
        self._children[id(child)] = child
        return child

    def close(self) -> None:
        """Close this and, first, everything created from it (idempotent)."""
        if self._closed:
            return
        for child in reversed(list(self._children.values())):
            child.close()
        self._leave_parent()
