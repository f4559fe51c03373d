"""ServiceServer's bind: a port another server listens on is refused, not shared
(gRPC's default SO_REUSEPORT let a second server take half the connections)."""
import asyncio

import pytest

from services.common.server import ServiceServer


def test_a_port_in_use_is_refused_with_the_address_not_shared():
    async def main():
        first = ServiceServer("llmserve.test.Service", lambda server: None)
        address = await first.start("127.0.0.1", 0)
        try:
            second = ServiceServer("llmserve.test.Service", lambda server: None)
            with pytest.raises(OSError, match=f"cannot listen on {address} \\(--port\\): in use"):
                await second.start("127.0.0.1", int(address.rsplit(":", 1)[1]))
            with pytest.raises(OSError, match=r"\(--health-port\)"):
                await second._start_health_server("127.0.0.1", int(address.rsplit(":", 1)[1]))
        finally:
            await first.server.stop(None)

    asyncio.run(main())
