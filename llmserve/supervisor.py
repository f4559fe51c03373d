"""Supervisor: starts a LocalStack's dead workers and engine cores again, with
backoff, each on its old address.

A worker that dies takes its KV cache and its model with it; its engine core
notices the failed step, waits for the worker to answer again, and recovers
every request by recomputation (EngineCore.recover_workers). The ranks of a
tensor-parallel group restart together: the survivors' process group cannot
take a new member, so one rank's death resets the whole group.
An engine core that dies is restarted with fresh workers; meanwhile the
frontend's router has moved its requests to the other replicas, and routes to
it again once it answers.
"""
from __future__ import annotations

import logging
import signal
import threading
import time

from llmserve.launcher import LocalStack, ServiceProcess

logger = logging.getLogger(__name__)
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class Supervisor(threading.Thread):
    def __init__(self, stack: LocalStack, poll_s: float = 0.2):
        super().__init__(name="llmserve-supervisor", daemon=True)
        self.stack, self.poll_s = stack, poll_s
        self._stopping = threading.Event()
        self._backoff: dict[str, float] = {}  # worker group -> next delay
        self._next_try: dict[str, float] = {}  # worker group -> when to try again

    def stop(self) -> None:
        self._stopping.set()
        self.join()

    def run(self) -> None:
        while not self._stopping.wait(self.poll_s):
            for group, (engine, workers) in _replica_groups(self.stack.services).items():
                if engine is not None and engine.process.poll() is not None:
                    self._restart(group, workers + [engine])
                elif any(w.process.poll() is not None for w in workers):
                    self._restart(group, workers)
                else:
                    self._backoff.pop(group, None)  # healthy: the next failure waits 1 s

    def _restart(self, group: str, services: list[ServiceProcess]) -> None:
        """Kills what is left of `services` and starts them all again, in order."""
        now = time.monotonic()
        if now < self._next_try.get(group, 0.0):
            return
        delay = self._backoff.get(group, FIRST_BACKOFF_S)
        self._backoff[group] = min(2 * delay, MAX_BACKOFF_S)
        self._next_try[group] = now + delay
        dead = [s.name for s in services if s.process.poll() is not None]
        print(f"llmserve: {', '.join(dead)} exited; restarting "
              f"{', '.join(s.name for s in services)}", flush=True)
        for service in services:  # the survivors of a TP group go too
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGKILL)
                service.process.wait()
        try:
            for service in services:
                self.stack.restart(service)
        except (RuntimeError, TimeoutError) as e:
            print(f"llmserve: restarting failed ({e}); next try in {delay:.0f} s", flush=True)


def _replica_groups(services: list[ServiceProcess]
                    ) -> dict[str, tuple[ServiceProcess | None, list[ServiceProcess]]]:
    """Replica suffix ("", "-0", "-1" ...) -> (its engine core, its worker ranks)."""
    groups: dict[str, tuple[ServiceProcess | None, list[ServiceProcess]]] = {}
    for service in services:
        if not service.address:
            continue
        if service.name.startswith("engine-core"):
            suffix = service.name.removeprefix("engine-core")
            groups[suffix] = (service, groups.get(suffix, (None, []))[1])
        elif service.name.startswith("worker"):
            suffix = service.name.removeprefix("worker").split("-rank")[0]
            groups.setdefault(suffix, (None, []))[1].append(service)
    return groups
