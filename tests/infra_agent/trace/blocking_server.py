"""A small asyncio HTTP server (plain asyncio streams, no spans) for the thread-state tests.

``--blocking``: its handler calls ``time.sleep`` on the event-loop thread, which holds up
every other connection; without it the handler awaits ``asyncio.sleep``, and the loop
waits in its selector meanwhile.  Prints its port once it listens.
"""

import asyncio
import sys
import time

BLOCKING = "--blocking" in sys.argv
PAUSE_S = 0.02


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:  # the request head; no body is sent
        line = await reader.readline()
        if not line or line in (b"\r\n", b"\n"):
            break
    if BLOCKING:
        time.sleep(PAUSE_S)  # BLOCKS_THE_LOOP
    else:
        await asyncio.sleep(PAUSE_S)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
    await writer.drain()
    writer.close()


async def main() -> None:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


asyncio.run(main())
