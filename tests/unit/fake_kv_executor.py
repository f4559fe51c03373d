"""A fake executor that keeps each KV block's contents (the token at each slot), so
tests can check what beam search's block sharing promises: a shared block is
never written, a copy is made before the write that needs it, and every
sequence's blocks hold exactly its tokens. Its 'model' gives each sequence a
deterministic distribution over a few tokens (EOS among them now and then)."""
from __future__ import annotations

from services.common.request_types import LoadedModel, Logprobs
from services.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tests.unit.fake_executor import FakeExecutor

VOCAB_SIZE = 500
EOS = 3


def distribution(token_ids: list[int], k: int) -> list[tuple[int, float]]:
    """The sequence's k most likely next tokens with their logprobs, best first."""
    h = (sum(t * (i + 1) for i, t in enumerate(token_ids[-8:])) * 2654435761 + len(token_ids))
    h %= 2 ** 32
    tokens = []
    for i in range(k):
        token = EOS if i == h % 11 else (h // (i + 1) + 97 * i) % VOCAB_SIZE
        if token not in tokens:
            tokens.append(token)
    return [(t, -0.3 - 0.4 * i - ((h >> i) % 5) * 0.07) for i, t in enumerate(tokens)]


class FakeKVExecutor(FakeExecutor):
    def __init__(self, num_blocks: int, block_size: int):
        super().__init__(num_blocks, block_size)
        self.contents: dict[int, list[int | None]] = {}
        self.num_copies = 0

    def load_model(self, config):
        return LoadedModel(vocab_size=VOCAB_SIZE, dtype="float32", kv_block_bytes=1)

    def init_kv_cache(self, num_blocks):
        self.contents = {b: [None] * self.block_size for b in range(num_blocks)}

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for src, dst in so.blocks_to_copy:
            self.contents[dst] = list(self.contents[src])
            self.num_copies += 1
        self._apply_diff(so)
        starts = {r: self.requests[r]["computed"] for r in so.num_scheduled_tokens}
        # As in a forward pass: every token's KV is written, then attention reads.
        for request_id, n in so.num_scheduled_tokens.items():
            self._write(request_id, starts, n)
        output = ModelRunnerOutput()
        for request_id in so.num_scheduled_tokens:
            state = self.requests[request_id]
            self._check_reads(request_id, state)
            if state["computed"] == len(state["tokens"]):
                self._sample(request_id, state, output)
        return output

    def _apply_diff(self, so: SchedulerOutput) -> None:
        for request_id in so.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in so.new_requests:
            self.requests[new.request_id] = {
                "tokens": list(new.token_ids), "blocks": list(new.block_ids),
                "computed": new.num_computed_tokens, "prompt": new.num_prompt_tokens,
                "k": new.sampling_params.logprobs}
        for cached in so.cached_requests:
            state = self.requests[cached.request_id]
            assert state["computed"] == cached.num_computed_tokens, (cached, state)
            state["blocks"] += cached.new_block_ids
            if cached.new_token_ids:  # the scheduler's tokens replace what it sampled
                start = max(cached.num_computed_tokens, state["prompt"])
                state["tokens"][start:] = cached.new_token_ids

    def _write(self, request_id: str, starts: dict[str, int], n: int) -> None:
        """Writes the request's scheduled tokens. A block that another request of the
        step holds too may be written only where that one counts the position as
        computed (a prefix-cache hit on a block this step fills); where it would
        write the position too, the shared block should have been copied first."""
        state, bs = self.requests[request_id], self.block_size
        start, end = starts[request_id], starts[request_id] + n
        assert end <= len(state["tokens"]), f"{request_id}: scheduled tokens it does not have"
        for pos in range(start, end):
            block = state["blocks"][pos // bs]
            for other_id, other_start in starts.items():
                other = self.requests[other_id]
                if other_id != request_id and block in other["blocks"]:
                    assert other["blocks"].index(block) == pos // bs and other_start > pos, \
                        f"{request_id} writes position {pos} of block {block}, shared with " \
                        f"{other_id}, which has not computed it"
            self.contents[block][pos % bs] = state["tokens"][pos]
        state["computed"] = end

    def _check_reads(self, request_id: str, state: dict) -> None:
        """Everything the request attends to is its own sequence's KV."""
        bs = self.block_size
        for pos in range(state["computed"]):
            assert self.contents[state["blocks"][pos // bs]][pos % bs] == state["tokens"][pos], \
                f"{request_id}: position {pos} holds another sequence's KV"

    def _sample(self, request_id: str, state: dict, output: ModelRunnerOutput) -> None:
        k = state["k"]
        top = distribution(state["tokens"], max(k or 0, 1))
        token, logprob = top[0]
        state["tokens"].append(token)
        output.sampled_token_ids[request_id] = [token]
        if k is not None:
            output.logprobs[request_id] = [Logprobs(token, logprob, 1, [t for t, _ in top][:k],
                                                    [lp for _, lp in top][:k])]
