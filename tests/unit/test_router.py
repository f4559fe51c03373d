"""EngineRouter's choice of replica, with fake engine clients (no processes)."""
import asyncio

from services.common.request_types import EngineCoreOutput, EngineCoreRequest, FinishReason
from services.common.sampling_params import SamplingParams
from services.frontend.router import EngineRouter, _Replica


class FakeClient:
    def __init__(self, address):
        self.address = address
        self.served = []
        self.release = asyncio.Event()

    async def generate(self, request):
        self.served.append(request.request_id)
        await self.release.wait()
        yield EngineCoreOutput(request.request_id, [1], FinishReason.LENGTH)


def router_with(n):
    router = EngineRouter.__new__(EngineRouter)
    router.replicas = [_Replica(FakeClient(f"r{i}")) for i in range(n)]
    for r in router.replicas:
        r.healthy = True
    router._owner, router._prompts, router._poller = {}, {}, None
    return router


async def drive(router, requests):
    async def one(r):
        return [o async for o in router.generate(r)]
    tasks = [asyncio.create_task(one(r)) for r in requests]
    await asyncio.sleep(0.01)
    served = {r.client.address: list(r.client.served) for r in router.replicas}
    for r in router.replicas:
        r.client.release.set()
    await asyncio.gather(*tasks)
    return served


def request(rid, prompt):
    return EngineCoreRequest(rid, prompt, SamplingParams())


def test_least_loaded_spreads_and_same_prompt_sticks():
    async def run():
        router = router_with(2)
        served = await drive(router, [request("a", [1, 2, 3]), request("b", [4, 5, 6]),
                                      request("c-0", [7, 8]), request("c-1", [7, 8]),
                                      request("c-2", [7, 8])])
        # a and b spread; the three choices of c follow c-0 to share its prefix cache.
        assert served == {"r0": ["a", "c-0", "c-1", "c-2"], "r1": ["b"]}
        assert router._prompts == {} and all(r.in_flight == 0 for r in router.replicas)

        router = router_with(2)
        router.replicas[0].healthy = False
        served = await drive(router, [request("x", [1]), request("y", [2])])
        assert served["r0"] == [] and served["r1"] == ["x", "y"]
    asyncio.run(run())
