"""The batch verbs on the built-in engine where its own rules show: a CQ overrun reads the
same through ``poll_into`` as through ``poll``."""

from __future__ import annotations

import errno

import pytest
import trio
from test_resources import BOUND, connected, post_receives

from rdmashim import (
    Access,
    AsyncEventType,
    SendBatch,
    SendFlags,
    SendWR,
    VerbsError,
    WCArray,
    WROpcode,
)


async def test_poll_into_after_an_overrun_is_eoverflow() -> None:
    async with connected(prepare=post_receives(8), cqe=4) as pair:
        client = pair.client
        src = client.pd.reg_mr(b"overrun!", Access(0))
        batch = SendBatch(
            SendWR(i, WROpcode.SEND, [src.sge()], SendFlags.SIGNALED) for i in range(8)
        )
        client.qp.post_send_batch(batch)
        with trio.fail_after(BOUND):
            event = await client.context.get_async_event()
        assert (event.event_type, event.element) == (AsyncEventType.CQ_ERR, client.send_cq)
        cq = client.send_cq
        for poll in (lambda: cq.poll_into(WCArray(16)), lambda: cq.poll(16)):
            with pytest.raises(VerbsError) as info:
                poll()
            assert info.value.errno == errno.EOVERFLOW
