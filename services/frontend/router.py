"""EngineRouter: one EngineClient over several engine-core replicas.

Each new request goes to the least-loaded healthy replica: the requests this
frontend has in flight there plus the waiting queue the replica last reported;
except that a request with the same prompt as one in flight (the n choices of
one request, say) follows it, so that it finds that prompt in the same prefix
cache. (Keying on a shorter prefix would send every chat to one replica: chat
templates start alike.)
A replica that fails a call or a stats poll is taken out until a poll succeeds
again; requests in flight on a replica that dies go on on another one (see
generate), and end with UNAVAILABLE only when no replica is left.
The replicas are what the engine-core addresses resolve to (engine_addresses.py):
a DNS name is resolved again every refresh_interval_s, and replicas join or
leave routing as its records change.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Callable

import grpc

from services.common.errors import LLMServeError, Unavailable
from services.common.request_types import EngineCoreRequest, EngineStats
from services.common.tls import TlsConfig
from services.frontend.engine_addresses import DnsAddresses, ResolveError, StaticAddresses
from services.frontend.engine_client import EngineClient, GrpcEngineClient

logger = logging.getLogger(__name__)


class _Replica:
    def __init__(self, client: GrpcEngineClient):
        self.client = client
        self.healthy = False
        self.in_flight = 0
        self.waiting = 0  # as last reported by the replica

    @property
    def load(self) -> int:
        return self.in_flight + self.waiting


class EngineRouter(EngineClient):
    def __init__(self, addresses: StaticAddresses | DnsAddresses, tls: TlsConfig = TlsConfig(),
                 poll_interval_s: float = 0.5, refresh_interval_s: float = 5.0,
                 connect: Callable[[str], EngineClient] | None = None):
        """connect makes the client of one address (default: a GrpcEngineClient)."""
        self.addresses = addresses
        self.poll_interval_s, self.refresh_interval_s = poll_interval_s, refresh_interval_s
        # An IP from a DNS name is checked against that name's certificate.
        server_name = addresses.host if isinstance(addresses, DnsAddresses) else ""
        self._connect = connect or (lambda address: GrpcEngineClient(address, tls, server_name))
        self.replicas: list[_Replica] = []
        self._owner: dict[str, _Replica] = {}
        # Prompt -> (replica, requests in flight with it).
        self._prompts: dict[tuple[int, ...], tuple[_Replica, int]] = {}
        self._tasks: set[asyncio.Task] = set()

    async def start(self, timeout_s: float) -> None:
        """Waits until the addresses name at least one engine core and each answers
        once; then keeps polling their load and, for a DNS name, resolving it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        await self._refresh()
        while not self.replicas:
            if loop.time() > deadline:
                raise Unavailable(f"{self.addresses} names no engine core after "
                                  f"{timeout_s:.0f} s")
            await asyncio.sleep(self.poll_interval_s)
            await self._refresh()
        remaining = max(deadline - loop.time(), 1.0)
        await asyncio.gather(*(r.client.wait_ready(remaining) for r in self.replicas))
        await self._poll_once()
        self._spawn(self._poll_forever())
        if self.addresses.dynamic:
            self._spawn(self._refresh_forever())

    async def generate(self, request):
        """Streams from one replica; when that replica dies (UNAVAILABLE) another
        takes the request over, from its prompt and the tokens already streamed,
        and the stream goes on as if nothing happened."""
        streamed: list[int] = []
        answered = False  # the request's prompt logprobs (if asked for) come first
        while True:
            replica = self._route(request)
            try:
                async for output in self._generate_on(replica, request):
                    streamed += output.new_token_ids
                    answered = True
                    yield output
                return
            except LLMServeError as e:
                if e.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._mark_down(replica, e)
                if not any(r.healthy for r in self.replicas):
                    raise Unavailable(
                        f"no engine core is reachable (the one at {replica.client.address} "
                        f"failed: {e}); retry later") from None
                logger.warning("request %s: engine core %s failed after %d tokens; resuming "
                               "on another", request.request_id, replica.client.address,
                               len(streamed))
                request = _continuation(request, streamed, answered)
                streamed = []

    def _route(self, request) -> _Replica:
        """The replica for a new request: where the same prompt is in flight, or the
        least loaded."""
        prompt = tuple(request.prompt_token_ids)
        owner, count = self._prompts.get(prompt, (None, 0))
        replica = owner if owner is not None and owner.healthy else self._pick()
        self._prompts[prompt] = (replica, count + 1 if replica is owner else 1)
        return replica

    async def _generate_on(self, replica: _Replica, request):
        replica.in_flight += 1
        self._owner[request.request_id] = replica
        try:
            async for output in replica.client.generate(request):
                yield output
        finally:
            replica.in_flight -= 1
            self._owner.pop(request.request_id, None)
            prompt = tuple(request.prompt_token_ids)
            owner, count = self._prompts.get(prompt, (None, 0))
            if owner is replica:
                if count > 1:
                    self._prompts[prompt] = (owner, count - 1)
                else:
                    del self._prompts[prompt]

    async def abort(self, request_ids):
        for request_id in request_ids:
            replica = self._owner.get(request_id)
            if replica is not None:
                await replica.client.abort([request_id])

    async def get_stats(self) -> EngineStats:
        """The first healthy replica's stats (each replica serves its own)."""
        return await self._pick().client.get_stats()

    async def get_info(self):
        return await self._pick().client.get_info()

    async def add_lora(self, lora):
        """On every replica up now; one that comes up later loads the adapter with
        the first request naming it."""
        await asyncio.gather(*(r.client.add_lora(lora) for r in self._healthy()))

    async def remove_lora(self, name):
        async def remove(replica: _Replica) -> None:
            try:
                await replica.client.remove_lora(name)
            except LLMServeError as e:
                if e.code != grpc.StatusCode.NOT_FOUND:  # never loaded there: nothing to do
                    raise
        await asyncio.gather(*(remove(r) for r in self._healthy()))

    async def close(self):
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.client.close() for r in self.replicas))

    def _healthy(self) -> list[_Replica]:
        healthy = [r for r in self.replicas if r.healthy]
        if not healthy:
            raise Unavailable("no engine core is reachable; retry later")
        return healthy

    def _pick(self) -> _Replica:
        return min(self._healthy(), key=lambda r: r.load)

    def _mark_down(self, replica: _Replica, error: Exception) -> None:
        if replica.healthy:
            logger.warning("engine core %s is down: %s", replica.client.address, error)
        replica.healthy = False

    async def _poll_once(self) -> None:
        async def poll(replica: _Replica) -> None:
            try:
                stats = await asyncio.wait_for(replica.client.get_stats(), self.poll_interval_s * 4)
            except (LLMServeError, asyncio.TimeoutError) as e:
                self._mark_down(replica, e)
                return
            if replica not in self.replicas:  # left routing while we asked
                return
            if not replica.healthy:
                logger.info("engine core %s is up", replica.client.address)
            replica.healthy, replica.waiting = True, stats.num_waiting
        await asyncio.gather(*(poll(r) for r in self.replicas))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self._poll_once()

    async def _refresh(self) -> None:
        """Brings the replicas in line with what the addresses resolve to now. New
        ones join once a poll answers; gone ones leave routing at once, and their
        connection closes when the requests they still stream end."""
        try:
            addresses = set(await self.addresses.resolve())
        except ResolveError as e:  # keep routing to what we know
            logger.warning("%s", e)
            return
        current = {r.client.address: r for r in self.replicas}
        for address in sorted(addresses - current.keys()):
            logger.info("engine core %s joins routing", address)
            self.replicas.append(_Replica(self._connect(address)))
        for address in sorted(current.keys() - addresses):
            logger.info("engine core %s leaves routing", address)
            replica = current[address]
            replica.healthy = False
            self.replicas.remove(replica)
            self._spawn(self._close_when_idle(replica))

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            await self._refresh()

    async def _close_when_idle(self, replica: _Replica) -> None:
        try:
            while replica.in_flight:
                await asyncio.sleep(self.poll_interval_s)
        finally:  # also when the router closes first
            await replica.client.close()

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _continuation(request: EngineCoreRequest, streamed: list[int],
                  answered: bool) -> EngineCoreRequest:
    """The request as another replica resumes it: the same prompt and parameters,
    after the tokens already streamed. Prompt logprobs are not asked again once
    the first replica answered (they come first; a prefill cut in the middle
    leaves them short)."""
    params = request.sampling_params
    if answered and params.prompt_logprobs is not None:
        params = dataclasses.replace(params, prompt_logprobs=None)
    return dataclasses.replace(request, sampling_params=params,
                               output_token_ids=request.output_token_ids + streamed)
