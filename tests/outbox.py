"""What a Python engine put out, sorted as a provider sorts it (the tests' hosts)."""

from __future__ import annotations

from typing import Any

from rdmashim.providers.softiwarp.jobs import Outcome, RecvRun
from rdmashim.verbs.enums import WCOpcode
from rdmashim.verbs.wr import WC


def sort_outbox(outbox: list[Outcome], send_wcs: list[WC], recv_wcs: list[WC]) -> list[Any]:
    """Move ``outbox``'s completions into ``send_wcs`` and ``recv_wcs`` (a run's one by
    one) and empty it; the events (Ready, Failed), in order."""
    events: list[Any] = []
    for item in outbox:
        if isinstance(item, RecvRun):
            recv_wcs += item.take(len(item))
        elif isinstance(item, list):
            send_wcs += item
        elif isinstance(item, WC):
            (recv_wcs if item.opcode is WCOpcode.RECV else send_wcs).append(item)
        else:
            events.append(item)
    outbox.clear()
    return events
