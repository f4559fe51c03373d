"""EngineRouter's choice of replica and its replica set, with fake engine clients
and addresses (no processes)."""
import asyncio
import dataclasses

from services.common.request_types import (EngineCoreOutput, EngineCoreRequest, EngineStats,
                                           FinishReason)
from services.common.sampling_params import SamplingParams
from services.frontend.engine_addresses import ResolveError, StaticAddresses
from services.frontend.router import EngineRouter
from tests.waiting import DEADLINE_S, until


class FakeClient:
    def __init__(self, address):
        self.address = address
        self.served = []
        self.release = asyncio.Event()

    async def generate(self, request):
        self.served.append(request.request_id)
        await self.release.wait()
        yield EngineCoreOutput(request.request_id, [1], FinishReason.LENGTH)

    async def wait_ready(self, timeout_s):
        pass

    async def get_stats(self):
        return EngineStats(*[0] * len(dataclasses.fields(EngineStats)))

    async def close(self):
        self.closed = True


async def router_with(n):
    router = EngineRouter(StaticAddresses([f"r{i}" for i in range(n)]), connect=FakeClient)
    await router._refresh()
    for r in router.replicas:
        r.healthy = True
    return router


async def drive(router, requests):
    async def one(r):
        return [o async for o in router.generate(r)]
    tasks = [asyncio.create_task(one(r)) for r in requests]
    await until(lambda: sum(len(r.client.served) for r in router.replicas) == len(requests),
                "every request reaching a replica")
    served = {r.client.address: list(r.client.served) for r in router.replicas}
    for r in router.replicas:
        r.client.release.set()
    await asyncio.gather(*tasks)
    return served


def request(rid, prompt):
    return EngineCoreRequest(rid, prompt, SamplingParams())


def test_least_loaded_spreads_and_same_prompt_sticks():
    async def run():
        router = await router_with(2)
        served = await drive(router, [request("a", [1, 2, 3]), request("b", [4, 5, 6]),
                                      request("c-0", [7, 8]), request("c-1", [7, 8]),
                                      request("c-2", [7, 8])])
        # a and b spread; the three choices of c follow c-0 to share its prefix cache.
        assert served == {"r0": ["a", "c-0", "c-1", "c-2"], "r1": ["b"]}
        assert router._prompts == {} and all(r.in_flight == 0 for r in router.replicas)

        router = await router_with(2)
        router.replicas[0].healthy = False
        served = await drive(router, [request("x", [1]), request("y", [2])])
        assert served["r0"] == [] and served["r1"] == ["x", "y"]
    asyncio.run(run())


class FakeDnsName:
    """Addresses that change when the test says; an exception is raised as a failed lookup."""
    dynamic = True

    def __init__(self, *addresses):
        self.now = list(addresses)
        self.lookups = 0

    async def resolve(self):
        self.lookups += 1
        if isinstance(self.now, Exception):
            raise self.now
        return list(self.now)


def test_replicas_join_and_leave_as_the_name_resolves():
    async def run():
        name = FakeDnsName("a:1")
        router = EngineRouter(name, connect=FakeClient, poll_interval_s=0.01,
                              refresh_interval_s=0.01)
        await router.start(timeout_s=DEADLINE_S)
        assert [r.client.address for r in router.replicas] == ["a:1"]
        first = router.replicas[0]

        name.now = ["a:1", "b:1"]  # scaled up: b joins once its first poll answers
        await until(lambda: [(r.client.address, r.healthy) for r in router.replicas] == [
            ("a:1", True), ("b:1", True)], "b joining, healthy")

        stream = router.generate(request("on-a", [9]))
        pending = asyncio.ensure_future(stream.__anext__())
        owner = await until(lambda: router._owner.get("on-a"), "the request routed")
        name.now = ["b:1"] if owner is first else ["a:1"]  # its replica leaves
        await until(lambda: owner not in router.replicas, "its replica leaving")
        assert not getattr(owner.client, "closed", False)
        owner.client.release.set()  # the request in flight still finishes there
        assert (await pending).new_token_ids == [1]
        assert [o async for o in stream] == []
        await until(lambda: getattr(owner.client, "closed", False), "the replica's client closed")

        name.now = ResolveError("no DNS server answered")  # keep what we know
        lookups = name.lookups
        await until(lambda: name.lookups >= lookups + 3, "three failed lookups")
        assert len(router.replicas) == 1
        name.now = []  # no ready pod at all
        await until(lambda: router.replicas == [], "every replica gone")
        await router.close()
    asyncio.run(run())


def test_start_waits_for_the_name_to_have_an_address():
    async def run():
        name = FakeDnsName()
        router = EngineRouter(name, connect=FakeClient, poll_interval_s=0.01)
        starting = asyncio.ensure_future(router.start(timeout_s=60.0))
        await until(lambda: name.lookups >= 3, "three empty lookups")
        assert not starting.done()
        name.now = ["a:1"]
        await asyncio.wait_for(starting, DEADLINE_S)
        assert [r.healthy for r in router.replicas] == [True]
        await router.close()
    asyncio.run(run())
