"""How the rdmashim commands read their arguments and how they end.

Every command-line tool of the project (``rdmashim ...``, ``python -m
rdmashim``, ``examples/*.py``) builds its parser with :class:`Parser` and the
argument types here, and runs through :func:`run_command`, so bad input is
refused before anything starts and every ending looks the same:

- an argument out of range or malformed: ``PROG: error: ...`` on one line,
  exit status 2 (:data:`EXIT_USAGE`), also for a :class:`UsageError` raised
  once the arguments are combined;
- a failure while running (a refused connection, an unknown device, a port
  in use): ``PROG: error: ...`` on one line, exit status 1;
- Ctrl-C: no output of its own, exit status 130 (a command that measured
  something prints it first); SIGTERM caught by a command: 143;
- stdout closed by its reader (``| head``): quietly, status 141, as a shell's tools.

Errors raised inside trio nurseries arrive in exception groups; the first
real error of the group is the one reported. A traceback is shown only for
``RDMASHIM_TRACEBACK=1``.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import re
import select
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from rdmashim.verbs.tasks import leaves

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_SIGINT = 128 + signal.SIGINT
EXIT_SIGPIPE = 128 + getattr(signal, "SIGPIPE", 13)  # Windows has no SIGPIPE; 13 elsewhere
TRACEBACK_VAR = "RDMASHIM_TRACEBACK"
"""Set to 1 to see the traceback of an error as well as its line."""
MIN_RATE_SECONDS = 0.01
"""Intervals shorter than this get no rate (a rate over nothing is noise)."""

_BUGS = (AssertionError, AttributeError, KeyError, IndexError, NameError, TypeError, RuntimeError)
"""Exceptions that mean a defect of rdmashim rather than bad input or a failing peer."""


class UsageError(Exception):
    """The arguments do not fit together; reported like a parser error (exit status 2)."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line: ``PROG: error: MESSAGE (see PROG -h)``."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


# ------------------------------------------------------------------ argument types
def integer(low: int | None = None, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in ``low..high`` (either bound may be open)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 0)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        _check_range(text, value, low, high)
        return value

    return parse


_SIZE = re.compile(r"([-+]?\d+)\s*([kmgt]?)(i?b)?", re.IGNORECASE)
_SIZE_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}


def size(low: int = 0, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: bytes, as ``4096``, ``64K``, ``1M``, ``1GiB`` (powers of 1024)."""

    def parse(text: str) -> int:
        match = _SIZE.fullmatch(text.strip())
        if match is None:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a size (bytes, or with K, M, G: 4096, 64K, 1M)"
            )
        value = int(match[1]) << _SIZE_SHIFT[match[2].lower()]
        _check_range(text, value, low, high)
        return value

    return parse


_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_duration(text: str) -> float:
    """Seconds from ``1``, ``0.2``, ``200ms``, ``500usec`` (units s, ms, msec, us, usec)."""
    number = text.strip().rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text.strip()[len(number) :]
    try:
        seconds = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ValueError(f"{text!r} is not a duration (seconds, or with ms, us)") from None
    if not math.isfinite(seconds):
        raise ValueError(f"{text!r} is not a duration (seconds, or with ms, us)")
    return seconds


def duration(*, zero: bool = False, least: float = 0.0) -> Callable[[str], float]:
    """An argparse type: a duration (:func:`parse_duration`) over 0 (``zero``: or 0), at
    least ``least`` seconds."""

    def parse(text: str) -> float:
        try:
            seconds = parse_duration(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if seconds < 0 or (seconds == 0 and not zero) or 0 < seconds < least:
            span = f"at least {least:g} s" if least else "more than 0 s"
            raise argparse.ArgumentTypeError(
                f"{text!r} is out of range ({'0 s or more' if zero else span})"
            )
        return seconds

    return parse


port = integer(0, 65535)
"""An argparse type: a TCP or RDS port, 0..65535."""


def host(text: str) -> str:
    """An argparse type: an IP address, or a host name resolved to one (IPv4 first)."""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(text, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise argparse.ArgumentTypeError(f"cannot resolve {text!r}: {why}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0])


def backend(text: str) -> str:
    """An argparse type: the name of a registered backend."""
    from rdmashim.registry import BACKENDS

    if text not in BACKENDS:
        known = ", ".join(sorted(BACKENDS))
        raise argparse.ArgumentTypeError(f"no backend {text!r} (known: {known})")
    return text


def _check_range(text: str, value: float, low: float | None, high: float | None) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        span = f"{'' if low is None else low} .. {'' if high is None else high}".strip()
        raise argparse.ArgumentTypeError(f"{text!r} is out of range ({span})")


def rate(amount: float, seconds: float) -> float | None:
    """``amount / seconds``, or None when the interval is too short to mean anything."""
    return amount / seconds if seconds >= MIN_RATE_SECONDS else None


# ------------------------------------------------------------------ the ending
def describe(exc: BaseException) -> str:
    """The one line that reports ``exc``: its message; a defect's type as well."""
    text = " ".join(str(exc).split())
    if isinstance(exc, MemoryError):
        return f"out of memory{': ' + text if text else ''}"
    if isinstance(exc, _BUGS):
        return f"internal error: {type(exc).__name__}: {text} (set {TRACEBACK_VAR}=1 to see where)"
    return text or type(exc).__name__


def run_command(prog: str, body: Callable[[], int | None]) -> int:
    """Run ``body`` and turn how it ends into an exit status and at most one line on stderr."""
    try:
        status = body()
    except SystemExit as exc:  # argparse, sys.exit: already said what it had to
        return _exit_status(exc)
    except BaseException as exc:  # every ending is mapped, none escapes
        found = leaves(exc)
        if any(isinstance(leaf, KeyboardInterrupt) for leaf in found):
            return EXIT_SIGINT
        if any(isinstance(leaf, BrokenPipeError) for leaf in found) and _stdout_gone():
            return EXIT_SIGPIPE
        exits = [leaf for leaf in found if isinstance(leaf, SystemExit)]
        if exits:
            return _exit_status(exits[0])
        real = [leaf for leaf in found if isinstance(leaf, Exception)] or found
        first = real[0]
        if os.environ.get(TRACEBACK_VAR) == "1":
            traceback.print_exception(exc)
        print(f"{prog}: error: {describe(first)}", file=sys.stderr, flush=True)
        return EXIT_USAGE if isinstance(first, UsageError) else EXIT_ERROR
    return 0 if status is None else int(status)


def _exit_status(exc: SystemExit) -> int:
    """The status ``sys.exit(code)`` means; a message for a code is printed as Python does."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr, flush=True)
    return EXIT_ERROR


def _stdout_gone() -> bool:
    """Whether stdout's reader went away (``rdmashim ... | head``); stdout is silenced then."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no poll, or no real stdout
        return False
    if gone:  # nothing more can be written; the flush at exit must not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return gone


def check_backend_env() -> None:
    """Refuse an unknown ``RDMASHIM_BACKEND`` before anything starts (a UsageError)."""
    from rdmashim.registry import ENV_VAR

    name = os.environ.get(ENV_VAR)
    if name:
        try:
            backend(name)
        except argparse.ArgumentTypeError as exc:
            raise UsageError(f"{ENV_VAR}: {exc}") from None


__all__ = [
    "EXIT_ERROR",
    "EXIT_SIGINT",
    "EXIT_SIGPIPE",
    "EXIT_USAGE",
    "MIN_RATE_SECONDS",
    "Parser",
    "UsageError",
    "backend",
    "check_backend_env",
    "describe",
    "duration",
    "host",
    "integer",
    "parse_duration",
    "port",
    "rate",
    "run_command",
    "size",
]
