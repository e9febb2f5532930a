from rdmashim import RecvWR, SendWR, WCStatus, WROpcode


async def test_send_write_read(pair):
    client, server = pair
    rbuf = server.reg(4096)
    server.qp.post_recv(RecvWR(1, [rbuf.sge()]))
    sbuf = client.reg(b"hello world".ljust(100, b"!"))
    client.qp.post_send(SendWR(7, WROpcode.SEND, [sbuf.sge(0, 100)]))
    wc = (await server.recv_cq.poll_wait())[0]
    assert wc.status == WCStatus.SUCCESS and wc.byte_len == 100
    assert bytes(rbuf.buf[:11]) == b"hello world"
    wc = (await client.send_cq.poll_wait())[0]
    assert wc.wr_id == 7 and wc.status == WCStatus.SUCCESS
    # write 1 MiB then read it back
    src = client.reg(bytes(range(256)) * 4096)
    dst = server.reg(1 << 20)
    client.qp.post_send(
        SendWR(8, WROpcode.RDMA_WRITE, [src.sge()], remote_addr=dst.addr, rkey=dst.rkey)
    )
    wc = (await client.send_cq.poll_wait())[0]
    assert wc.status == WCStatus.SUCCESS
    back = client.reg(1 << 20)
    client.qp.post_send(
        SendWR(9, WROpcode.RDMA_READ, [back.sge()], remote_addr=dst.addr, rkey=dst.rkey)
    )
    wc = (await client.send_cq.poll_wait())[0]
    assert wc.status == WCStatus.SUCCESS, wc
    assert bytes(back.buf) == bytes(src.buf) == bytes(dst.buf)
