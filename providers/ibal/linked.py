"""IBAL's singly linked lists (``p_next``) of work requests and completions, in Python.

IBAL passes work requests and work completions as chains linked through a
``p_next`` field (None ends the chain). :func:`link` makes a chain of a
sequence, :func:`walk` goes along one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def walk(head: T | None) -> Iterator[T]:
    """The entries of the chain starting at ``head``, in order."""
    node: Any = head
    while node is not None:
        yield node
        node = node.p_next


def link(entries: Sequence[T]) -> T | None:
    """Chain ``entries`` in order through their ``p_next``; returns the head (None if empty)."""
    for entry, following in itertools.pairwise(entries):
        entry.p_next = following  # type: ignore[attr-defined]
    if entries:
        entries[-1].p_next = None  # type: ignore[attr-defined]
        return entries[0]
    return None
