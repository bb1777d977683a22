"""A TCP relay that delays every chunk by a fixed time in each direction (this kernel has no
netem). Order is kept and throughput is not capped: chunks are forwarded `delay` after arrival.

    python delay_relay.py LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_S [LISTEN_PORT TARGET_HOST TARGET_PORT ...]
"""

import asyncio
import sys
import time


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float) -> None:
    queue: asyncio.Queue = asyncio.Queue()

    async def forward() -> None:
        while True:
            due, data = await queue.get()
            if data is None:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
        writer.close()

    task = asyncio.create_task(forward())
    while True:
        data = await reader.read(1 << 16)
        await queue.put((time.monotonic() + delay, data or None))
        if not data:
            break
    await task


async def main(args: list[str]) -> None:
    servers = []
    for i in range(0, len(args), 4):
        listen, host, port, delay = int(args[i]), args[i + 1], int(args[i + 2]), float(args[i + 3])

        async def handle(r, w, host=host, port=port, delay=delay):
            tr, tw = await asyncio.open_connection(host, port)
            await asyncio.gather(pump(r, tw, delay), pump(tr, w, delay), return_exceptions=True)

        servers.append(await asyncio.start_server(handle, "127.0.0.1", listen))
    print("relaying", flush=True)
    await asyncio.gather(*(s.serve_forever() for s in servers))


asyncio.run(main(sys.argv[1:]))
