"""PipelineStage: this worker's place in the pipeline (pipeline parallelism): its
contiguous share of the decoder layers, and the ranks its intermediate tensors
(hidden states and residual) come from and go to.

With one stage (the default) it holds every layer and sends nothing. Ranks are
numbered stage-major, as in vLLM: global rank = stage × TP size + TP rank, so
TP rank t of stage i talks to TP rank t of stages i - 1 and i + 1 only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def partition_layers(num_layers: int, num_stages: int, partition: str = "") -> list[int]:
    """Layers per stage: `partition` ("8,8,7,7") when given, else vLLM's rule (even
    shares; the remainder goes to the stages before the last, from the end, since the
    last one also runs the final norm and the LM head)."""
    if partition:
        try:
            parts = [int(x) for x in partition.split(",")]
        except ValueError:
            raise ValueError(f"--pp-layer-partition {partition!r}: give comma-separated "
                             "layer counts, one per stage") from None
        if len(parts) != num_stages or sum(parts) != num_layers or min(parts) < 1:
            raise ValueError(f"--pp-layer-partition {partition!r}: needs {num_stages} "
                             f"counts of at least 1 that add up to the model's {num_layers} "
                             "layers")
        return parts
    if num_layers < num_stages:
        raise ValueError(f"--pipeline-parallel-size {num_stages} exceeds the model's "
                         f"{num_layers} layers: each stage needs at least one")
    parts = [num_layers // num_stages] * num_stages
    for i in range(2, num_layers % num_stages + 2):
        parts[-i] += 1
    return parts


@dataclass
class IntermediateTensors:
    """What one stage hands the next: the last layer's output, not yet added to the
    residual stream, and the residual stream."""

    hidden: torch.Tensor
    residual: torch.Tensor


@dataclass
class PipelineStage:
    rank: int = 0  # the stage's index
    size: int = 1  # stages
    start_layer: int = 0
    end_layer: int | None = None  # None: every layer
    # The global ranks of this TP rank in the stages before and after (None at the ends).
    prev_rank: int | None = None
    next_rank: int | None = None
    # Seconds spent waiting for the previous stage's tensors: this stage's share of
    # the pipeline bubble (the first stage's is the time between its steps).
    recv_wait_s: float = 0.0
    # Sends still in flight (their tensors must live until they complete).
    _sends: list = field(default_factory=list, repr=False)

    @classmethod
    def of(cls, global_rank: int, tp_size: int, num_stages: int, num_layers: int,
           partition: str = "") -> "PipelineStage":
        """The stage of a global rank, for a model of num_layers layers."""
        stage = global_rank // tp_size
        parts = partition_layers(num_layers, num_stages, partition)
        start = sum(parts[:stage])
        return cls(stage, num_stages, start, start + parts[stage],
                   global_rank - tp_size if stage > 0 else None,
                   global_rank + tp_size if stage < num_stages - 1 else None)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def owns(self, layer: int) -> bool:
        return self.start_layer <= layer and (self.end_layer is None or layer < self.end_layer)

    def send(self, tensors: IntermediateTensors) -> None:
        """To the next stage, without waiting for it to take them: this stage goes on
        with the next batch meanwhile (the batch queue)."""
        self._wait_sends()
        for t in (tensors.hidden.contiguous(), tensors.residual.contiguous()):
            self._sends.append((dist.isend(t, self.next_rank), t))

    def recv(self, num_tokens: int, hidden_size: int, dtype: torch.dtype,
             device: torch.device) -> IntermediateTensors:
        """From the previous stage: every stage computes the same step, so the shapes
        are known here."""
        hidden, residual = (torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
                            for _ in range(2))
        start = time.perf_counter()
        dist.recv(hidden, self.prev_rank)
        dist.recv(residual, self.prev_rank)
        self.recv_wait_s += time.perf_counter() - start
        return IntermediateTensors(hidden, residual)

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()


SINGLE_STAGE = PipelineStage()
