"""The emulator's relay (p2pfusion/cli/wan.py) in one process, on two loopback addresses: a client
that resets its connection to a frozen peer leaves the relay's copy from that peer waiting, and
what it sent still reaches the peer when it thaws, as TCP would carry it (asyncio keeps no
reference to such a connection's handler once the client's side is gone: the relay keeps it)."""

import asyncio
import gc

from p2pfusion.cli.wan import DelayRelay, Matrix, write_matrix

SENT = 100_000  # fits the sockets' buffers: the relay waits on the peer's answer, not on a send


async def scenario(tmp_path):
    problems = []
    asyncio.get_running_loop().set_exception_handler(
        lambda _loop, context: problems.append(f"{context['message']} {context.get('exception')!r}")
    )
    frozen: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def accept(reader, writer):  # greets, then reads nothing until it thaws
        writer.write(b"hello")
        frozen.append((reader, writer))

    peer = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = peer.sockets[0].getsockname()[1]
    write_matrix(tmp_path / "matrix.json", {"127.0.0.1": 0.01})
    serving = asyncio.ensure_future(DelayRelay("127.0.0.2", [port], Matrix(tmp_path / "matrix.json")).serve())
    for _ in range(50):
        try:
            _, writer = await asyncio.open_connection("127.0.0.2", port)
            break
        except OSError:
            await asyncio.sleep(0.05)
    writer.write(bytes(SENT))
    await writer.drain()
    await asyncio.sleep(0.1)
    writer.close()  # the client gives up on the frozen peer, its greeting unread: a reset
    await asyncio.sleep(0.3)
    gc.collect()
    received = 0
    try:
        while chunk := await asyncio.wait_for(frozen[0][0].read(1 << 20), 5.0):  # the peer thaws
            received += len(chunk)
    except TimeoutError:
        pass
    frozen[0][1].close()  # and ends the connection: so does the relay
    await asyncio.sleep(0.2)
    serving.cancel()
    peer.close()
    return received, problems


def test_what_a_client_sent_reaches_a_frozen_peer_when_it_thaws(tmp_path):
    received, problems = asyncio.run(scenario(tmp_path))
    assert received == SENT
    assert problems == []
