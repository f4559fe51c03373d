"""Which CPU cores a worker runs on. Workers that share a machine (tensor-parallel
ranks, engine replicas) each get their own cores: torch's thread teams spin while
they wait, so two teams on the same cores slow each other down many times over
(two replicas of all the cores each took 10x as long as one)."""
from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def split_cores(cores: list[int], parts: int) -> list[list[int]]:
    """`cores` in `parts` contiguous groups whose sizes differ by at most one; with
    fewer cores than parts, one core each, shared round robin."""
    if parts <= len(cores):
        size, extra = divmod(len(cores), parts)
        groups, start = [], 0
        for i in range(parts):
            end = start + size + (i < extra)
            groups.append(cores[start:end])
            start = end
        return groups
    return [[cores[i % len(cores)]] for i in range(parts)]


def format_cores(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def parse_cores(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]."""
    cores: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cores += range(int(first), int(last or first) + 1)
    return cores


def pin_to_cores(cores: list[int]) -> None:
    """Runs this process (and the threads it starts) on `cores`, with one torch
    thread per core."""
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    logger.info("running on CPU cores %s (%d torch threads)", format_cores(cores), len(cores))
