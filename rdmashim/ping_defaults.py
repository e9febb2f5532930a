"""rping's port, message format and sizes.

Plain values, so the CLI builds its parser from them without importing the
rdma_cm; :mod:`rdmashim.ping` uses the same ones.
"""

from __future__ import annotations

PORT = 7174
"""rping's default port."""
MSG_FMT = "rdma-ping-%d: "
"""``RPING_MSG_FMT``: the start of each ping's data."""
MIN_SIZE = len(str(2**31 - 1)) + 1 + len(MSG_FMT) + 1
"""``RPING_MIN_BUFSIZE`` = sizeof(stringify(INT_MAX)) + sizeof(RPING_MSG_FMT) = 26."""
MAX_SIZE = 64 * 1024 - 1
"""rping accepts ``-S`` up to ``RPING_BUFSIZE - 1``."""
DEFAULT_SIZE = 64

__all__ = ["DEFAULT_SIZE", "MAX_SIZE", "MIN_SIZE", "MSG_FMT", "PORT"]
