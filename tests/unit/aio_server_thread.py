"""A grpc.aio server on a thread of its own, for tests that call it through
sync stubs (as the engine core calls its workers)."""
import asyncio
import concurrent.futures
import threading
from contextlib import contextmanager
from typing import Callable, Iterator

import grpc


@contextmanager
def aio_server_thread(add_handlers: Callable[[grpc.aio.Server], None],
                      interceptors: list = ()) -> Iterator[tuple[str, Callable]]:
    """The server on a free port; yields (address, stop), stop(grace_s=None)
    stopping it early (as grpc.aio.Server.stop) and joining its thread."""
    started: concurrent.futures.Future = concurrent.futures.Future()
    grace: concurrent.futures.Future = concurrent.futures.Future()  # set: stop

    async def main():
        server = grpc.aio.server(interceptors=list(interceptors))
        add_handlers(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        started.set_result(port)
        await server.stop(await asyncio.wrap_future(grace))

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()

    def stop(grace_s=None):
        if not grace.done():
            grace.set_result(grace_s)
        thread.join(timeout=10)
    try:
        yield f"127.0.0.1:{started.result(timeout=10)}", stop
    finally:
        stop()
