"""Echo server for the transport stress test, run as a separate process.

One task receives; four other tasks send the replies, as in the kvtrio server, so that sends
keep consuming the receiver's FD edges. Usage: ``python echo_server.py ENDPOINT``; prints
``ready`` once bound and runs until killed.
"""

from __future__ import annotations

import sys

import trio
import zmq

from kvtrio.transport import Socket, open_socket


async def echo(router: Socket, workers: int) -> None:
    send, receive = trio.open_memory_channel[list[bytes]](256)

    async def worker() -> None:
        async for frames in receive:
            await router.send_multipart(frames)

    async with trio.open_nursery() as nursery:
        for _ in range(workers):
            nursery.start_soon(worker)
        while True:
            await send.send(await router.recv_multipart())


async def main(endpoint: str) -> None:
    async with open_socket(zmq.ROUTER) as router:
        router.bind(endpoint)
        print("ready", flush=True)
        await echo(router, workers=4)


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
