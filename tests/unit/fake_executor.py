"""An executor whose 'worker' keeps a persistent batch from the step diffs, as a
real one does, and 'samples' a token that depends only on the sequence so far."""
from __future__ import annotations

from typing import Callable

from services.common.request_types import FinishReason, LoadedModel
from services.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from services.engine_core.engine_core import EngineCore
from services.engine_core.executor import Executor

VOCAB_SIZE = 1000


def next_token(token_ids: list[int]) -> int:
    return (sum(token_ids) * 31 + len(token_ids)) % VOCAB_SIZE


def reference_tokens(prompt: list[int], max_tokens: int, eos: set[int],
                     max_model_len: int) -> list[int]:
    """What a request alone would generate."""
    tokens, out = list(prompt), []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        out.append(token)
        if token in eos or len(out) >= max_tokens or len(tokens) >= max_model_len:
            return out


class FakeExecutor(Executor):
    # As a remote worker's executor: the engine core overlaps steps when its
    # config asks (the fake still runs each step inside the call).
    overlaps_steps = True

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.requests: dict[str, dict] = {}
        self.loras: dict[int, str] = {}  # LoRA adapters "loaded": id -> path
        # The distinct adapters of each step's scheduled requests.
        self.step_loras: list[set[int]] = []

    def load_model(self, config):
        return LoadedModel(vocab_size=VOCAB_SIZE, dtype="float32", kv_block_bytes=1)

    def add_lora(self, lora_id, lora_path):
        self.loras[lora_id] = lora_path

    def remove_lora(self, lora_id):
        del self.loras[lora_id]

    def determine_num_kv_blocks(self):
        return self.num_blocks

    def init_kv_cache(self, num_blocks):
        pass

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in so.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in so.new_requests:
            assert new.lora_id == 0 or new.lora_id in self.loras, "adapter not loaded first"
            self.requests[new.request_id] = {"tokens": list(new.token_ids),
                                             "blocks": list(new.block_ids),
                                             "computed": new.num_computed_tokens,
                                             "lora": new.lora_id}
        for cached in so.cached_requests:
            state = self.requests[cached.request_id]
            assert state["computed"] == cached.num_computed_tokens
            state["blocks"] += cached.new_block_ids
        self.step_loras.append({self.requests[r]["lora"] for r in so.num_scheduled_tokens} - {0})
        sampled = {}
        for request_id, n in so.num_scheduled_tokens.items():
            state = self.requests[request_id]
            end = state["computed"] + n
            assert end <= len(state["tokens"]), "scheduled tokens the worker does not have"
            assert len(state["blocks"]) * self.block_size >= end, "no slot for a token's KV"
            state["computed"] = end
            if end == len(state["tokens"]):
                token = next_token(state["tokens"])
                state["tokens"].append(token)
                sampled[request_id] = [token]
        return ModelRunnerOutput(sampled)


def run_to_end(core: EngineCore, on_step: Callable[[EngineCore], None] | None = None
               ) -> tuple[dict[str, list[int]], dict[str, FinishReason]]:
    """Steps the engine core until it has no work: each request's tokens and finish
    reason. on_step(core) runs after each step."""
    tokens, reasons = {}, {}
    while core.has_work():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                reasons[output.request_id] = output.finish_reason
        if on_step is not None:
            on_step(core)
    return tokens, reasons
