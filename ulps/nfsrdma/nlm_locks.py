"""The NLM server's lock state, pure: POSIX byte-range locks, waiting requests, DOS shares.

A lock belongs to an owner, ``(caller_name, svid)``: the client host's name
and the number it gives the process (or open file) holding the lock, as
Linux's lockd keys them. Ranges are half-open ``[start, end)`` over the
64-bit offsets of NLM version 4; :data:`TO_EOF` (2**64) ends a lock taken
with length 0, "to the end of the file however far it grows". A range
whose end would pass 2**64 is :class:`RangeTooBig` (NLM4_FBIG).

The rules are POSIX ``fcntl`` ones: two owners conflict where their ranges
overlap and either lock is exclusive; an owner never conflicts with itself,
and its new lock replaces whatever it held over that range (upgrading or
downgrading it), merging with its own adjacent or overlapping locks of the
same kind; unlocking a range in the middle of a lock splits it. A request
that must wait (a blocking LOCK) is a :class:`Waiter`, queued per file in
arrival order; :meth:`LockTable.grant_waiters` hands each one its lock as
soon as nothing conflicts.

DOS share reservations (SHARE/UNSHARE) are kept beside the locks: one per
``(caller_name, oh)`` and file; a share conflicts with another owner's
whose deny mode covers its access or whose access its deny mode covers.

Everything is bounded: locks plus shares per host, in total, and waiters
per host; going past a bound is :class:`NoLocks` (NLM4_DENIED_NOLOCKS) and
changes nothing. The file is any hashable key (the server uses the
object's identity behind its NFS handle).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field, replace

TO_EOF = 1 << 64
"""The end of a lock that runs to the end of the file (taken with length 0)."""

Owner = tuple[str, int]
"""``(caller_name, svid)``: whose a lock is."""


class NoLocks(Exception):
    """A bound on the locks, shares or waiters would be passed (NLM4_DENIED_NOLOCKS)."""


class RangeTooBig(ValueError):
    """A range whose end lies past the 64-bit offsets (NLM4_FBIG)."""


def lock_range(offset: int, length: int) -> tuple[int, int]:
    """The half-open range of an NLM ``l_offset``/``l_len``; length 0 runs to :data:`TO_EOF`."""
    end = TO_EOF if length == 0 else offset + length
    if end > TO_EOF:
        raise RangeTooBig(f"offset {offset} + length {length} passes 2**64")
    return offset, end


def wire_range(start: int, end: int) -> tuple[int, int]:
    """The ``l_offset``/``l_len`` of a range (to :data:`TO_EOF`: length 0)."""
    return start, 0 if end == TO_EOF else end - start


@dataclass(frozen=True, slots=True)
class HeldLock:
    """A lock held: its owner (and the owner handle it was last taken with), range, kind."""

    owner: Owner
    oh: bytes
    start: int
    end: int
    exclusive: bool

    def overlaps(self, start: int, end: int) -> bool:
        """Whether it covers any byte of ``[start, end)``."""
        return self.start < end and start < self.end

    def conflicts(self, owner: Owner, start: int, end: int, exclusive: bool) -> bool:
        """Whether it keeps ``owner`` from taking ``[start, end)`` of that kind."""
        return self.owner != owner and (exclusive or self.exclusive) and self.overlaps(start, end)


@dataclass(eq=False, slots=True)
class Waiter:
    """A lock request waiting for conflicting locks to go; ``context`` is the caller's."""

    file: Hashable
    owner: Owner
    oh: bytes
    start: int
    end: int
    exclusive: bool
    context: object = None

    def same_request(self, owner: Owner, start: int, end: int, exclusive: bool) -> bool:
        """Whether it is the request of ``owner`` for this range and kind."""
        return (self.owner, self.start, self.end, self.exclusive) == (owner, start, end, exclusive)


@dataclass(frozen=True, slots=True)
class ShareHeld:
    """A DOS share reservation: ``mode`` and ``access`` are the ``fsh4_*`` bits."""

    host: str
    oh: bytes
    mode: int
    access: int


def _minus(lock: HeldLock, start: int, end: int) -> list[HeldLock]:
    """What is left of ``lock`` outside ``[start, end)``: nothing, one piece or two."""
    if not lock.overlaps(start, end):
        return [lock]
    pieces = []
    if lock.start < start:
        pieces.append(replace(lock, end=start))
    if end < lock.end:
        pieces.append(replace(lock, start=end))
    return pieces


@dataclass(slots=True)
class _File:
    locks: list[HeldLock] = field(default_factory=list)
    waiters: list[Waiter] = field(default_factory=list)
    shares: list[ShareHeld] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.locks or self.waiters or self.shares)


class LockTable:
    """Every file's locks, waiters and shares, within the bounds given."""

    def __init__(
        self, *, max_total: int = 16384, max_per_host: int = 1024, max_waiters_per_host: int = 64
    ) -> None:
        self.max_total = max_total
        self.max_per_host = max_per_host
        self.max_waiters_per_host = max_waiters_per_host
        self._files: dict[Hashable, _File] = {}
        self._held: Counter[str] = Counter()
        """Locks plus shares per host."""
        self._waiting: Counter[str] = Counter()

    # -- queries

    def locks(self, file: Hashable) -> list[HeldLock]:
        """The locks held on ``file``, every owner's, in no particular order."""
        entry = self._files.get(file)
        return list(entry.locks) if entry else []

    def waiters(self, file: Hashable) -> list[Waiter]:
        """The requests waiting on ``file``, first come first."""
        entry = self._files.get(file)
        return list(entry.waiters) if entry else []

    def held(self, host: str | None = None) -> int:
        """Locks plus shares held by ``host`` (None: by everyone)."""
        return self._held[host] if host is not None else sum(self._held.values())

    def conflict(
        self, file: Hashable, owner: Owner, start: int, end: int, exclusive: bool
    ) -> HeldLock | None:
        """The first lock keeping ``owner`` from ``[start, end)`` of that kind, None if free."""
        entry = self._files.get(file)
        for lock in entry.locks if entry else ():
            if lock.conflicts(owner, start, end, exclusive):
                return lock
        return None

    # -- locks

    def _entry(self, file: Hashable) -> _File:
        return self._files.setdefault(file, _File())

    def _tidy(self, file: Hashable) -> None:
        entry = self._files.get(file)
        if entry is not None and entry.empty():
            del self._files[file]

    def _replace_own(self, file: Hashable, owner: Owner, mine: list[HeldLock]) -> None:
        """Make ``mine`` the locks ``owner`` holds on ``file``, within the bounds."""
        entry = self._entry(file)
        others = [lock for lock in entry.locks if lock.owner != owner]
        delta = len(mine) - (len(entry.locks) - len(others))
        host = owner[0]
        if delta > 0 and (
            self._held[host] + delta > self.max_per_host or self.held() + delta > self.max_total
        ):
            self._tidy(file)
            raise NoLocks(f"{host}: {self._held[host]} locks held, {self.held()} in all")
        entry.locks = others + mine
        self._held[host] += delta
        if not self._held[host]:
            del self._held[host]
        self._tidy(file)

    def _own(self, file: Hashable, owner: Owner) -> list[HeldLock]:
        entry = self._files.get(file)
        return [lock for lock in entry.locks if lock.owner == owner] if entry else []

    def lock(
        self, file: Hashable, owner: Owner, oh: bytes, start: int, end: int, exclusive: bool
    ) -> HeldLock | None:
        """Take ``[start, end)`` for ``owner``: None when taken, else the conflicting lock.

        Raises :class:`NoLocks` when the owner's new set of locks would pass a bound.
        """
        found = self.conflict(file, owner, start, end, exclusive)
        if found is not None:
            return found
        mine = [piece for lock in self._own(file, owner) for piece in _minus(lock, start, end)]
        new = HeldLock(owner, oh, start, end, exclusive)
        kept = []
        for lock in mine:  # after _minus none overlaps: merge the adjacent ones of its kind
            if lock.exclusive == exclusive and (lock.end == new.start or lock.start == new.end):
                new = replace(new, start=min(new.start, lock.start), end=max(new.end, lock.end))
            else:
                kept.append(lock)
        self._replace_own(file, owner, [*kept, new])
        return None

    def unlock(self, file: Hashable, owner: Owner, start: int, end: int) -> bool:
        """Release ``owner``'s locks over ``[start, end)``; whether anything was released.

        Splitting a lock in two counts against the bounds (:class:`NoLocks`).
        """
        mine = self._own(file, owner)
        left = [piece for lock in mine for piece in _minus(lock, start, end)]
        if left == mine:
            return False
        self._replace_own(file, owner, left)
        return True

    # -- waiters

    def wait(self, waiter: Waiter) -> Waiter:
        """Queue ``waiter`` (or find the same request queued already, and return that one)."""
        entry = self._entry(waiter.file)
        for queued in entry.waiters:
            if queued.same_request(waiter.owner, waiter.start, waiter.end, waiter.exclusive):
                return queued
        host = waiter.owner[0]
        if self._waiting[host] >= self.max_waiters_per_host:
            self._tidy(waiter.file)
            raise NoLocks(f"{host}: {self._waiting[host]} requests waiting")
        entry.waiters.append(waiter)
        self._waiting[host] += 1
        return waiter

    def _drop_waiter(self, entry: _File, waiter: Waiter) -> None:
        entry.waiters.remove(waiter)
        host = waiter.owner[0]
        self._waiting[host] -= 1
        if not self._waiting[host]:
            del self._waiting[host]

    def cancel(
        self, file: Hashable, owner: Owner, start: int, end: int, exclusive: bool
    ) -> Waiter | None:
        """Withdraw the waiting request of ``owner`` for that range and kind, if there is one."""
        entry = self._files.get(file)
        if entry is None:
            return None
        for waiter in entry.waiters:
            if waiter.same_request(owner, start, end, exclusive):
                self._drop_waiter(entry, waiter)
                self._tidy(file)
                return waiter
        return None

    def grant_waiters(self, file: Hashable) -> list[Waiter]:
        """Give every waiter of ``file`` that nothing blocks now its lock, in order; those.

        A waiter that cannot have its lock for the bounds stays queued.
        """
        entry = self._files.get(file)
        granted = []
        for waiter in list(entry.waiters) if entry else ():
            try:
                args = (waiter.owner, waiter.oh, waiter.start, waiter.end, waiter.exclusive)
                if self.lock(file, *args) is not None:
                    continue
            except NoLocks:
                continue
            self._drop_waiter(self._entry(file), waiter)
            granted.append(waiter)
        self._tidy(file)
        return granted

    # -- shares

    def share(self, file: Hashable, host: str, oh: bytes, mode: int, access: int) -> bool:
        """Take (or change) the share reservation of ``(host, oh)``; False if another conflicts."""
        entry = self._entry(file)
        others = [s for s in entry.shares if (s.host, s.oh) != (host, oh)]
        if any(access & s.mode or mode & s.access for s in others):
            self._tidy(file)
            return False
        if len(others) == len(entry.shares) and (
            self._held[host] >= self.max_per_host or self.held() >= self.max_total
        ):
            self._tidy(file)
            raise NoLocks(f"{host}: {self._held[host]} locks and shares held")
        if len(others) == len(entry.shares):
            self._held[host] += 1
        entry.shares = [*others, ShareHeld(host, oh, mode, access)]
        return True

    def unshare(self, file: Hashable, host: str, oh: bytes) -> bool:
        """Drop the share reservation of ``(host, oh)``; whether there was one."""
        entry = self._files.get(file)
        if entry is None:
            return False
        kept = [s for s in entry.shares if (s.host, s.oh) != (host, oh)]
        if len(kept) == len(entry.shares):
            return False
        entry.shares = kept
        self._held[host] -= 1
        if not self._held[host]:
            del self._held[host]
        self._tidy(file)
        return True

    # -- hosts

    def free_host(self, host: str) -> list[Hashable]:
        """Drop every lock, waiter and share of ``host``; the files that changed."""
        touched = []
        for file, entry in list(self._files.items()):
            locks = [lock for lock in entry.locks if lock.owner[0] != host]
            waiters = [w for w in entry.waiters if w.owner[0] != host]
            shares = [s for s in entry.shares if s.host != host]
            before = len(entry.locks) + len(entry.waiters) + len(entry.shares)
            if len(locks) + len(waiters) + len(shares) != before:
                entry.locks, entry.waiters, entry.shares = locks, waiters, shares
                touched.append(file)
                self._tidy(file)
        self._held.pop(host, None)
        self._waiting.pop(host, None)
        return touched
