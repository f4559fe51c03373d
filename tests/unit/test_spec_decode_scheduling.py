"""Speculative decoding in the scheduler, against a fake worker that keeps each KV
block's contents (fake_kv_executor.py), verifies drafts greedily against its
deterministic 'model' and proposes drafts that are sometimes wrong:
- every request emits what it emits without drafts, whatever else runs
  (preemption, chunked prefill, prefix caching, aborts, max_tokens, EOS);
- a step reads only KV its request wrote; the blocks that held only rejected
  drafts are freed at once, and every block is free at the end;
- drafts never preempt, never pass max_tokens or max_model_len, stop while the
  batch is large, and back off where they keep failing."""
from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services.common import convert
from services.common.config import (CacheConfig, EngineConfig, ModelConfig, SchedulerConfig,
                                    SpeculativeConfig)
from services.common.request_types import EngineCoreRequest, SamplingParams
from services.common.scheduler_output import ModelRunnerOutput, SchedulerOutput
from services.engine_core.engine_core import EngineCore
from services.engine_core.session import spec_decode_attributes
from tests.unit.fake_kv_executor import EOS, FakeKVExecutor, distribution
from tests.unit.test_scheduler_properties import check_invariants

BLOCK_SIZE = 4


def model_token(tokens: list[int]) -> int:
    return distribution(tokens, 1)[0][0]


class FakeSpecExecutor(FakeKVExecutor):
    """Verifies drafts as a worker does (greedy), then proposes the model's own
    continuation with every `wrong_every`-th draft position replaced."""

    def __init__(self, num_blocks: int, block_size: int, num_drafts: int, wrong_every: int,
                 max_model_len: int = 64):
        super().__init__(num_blocks, block_size)
        self.num_drafts = num_drafts
        self.wrong_every = wrong_every
        self.max_model_len = max_model_len
        self.steps: list[SchedulerOutput] = []

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(so)
        drafts = so.scheduled_spec_decode_tokens
        for request_id, d in drafts.items():  # the drafts follow its tokens, for the forward
            state = self.requests[request_id]
            assert so.num_scheduled_tokens[request_id] == len(d) + 1
            assert len(state["tokens"]) + len(d) < self.max_model_len  # room for one more
            state["tokens"] += d
            state["verifying"] = True
        output = super().execute_model(so)
        for request_id, d in drafts.items():
            self._verify(request_id, d, output)
        for request_id in output.sampled_token_ids:
            if request_id in so.requests_to_draft:
                output.spec_token_ids[request_id] = self._propose(
                    self.requests[request_id]["tokens"])
        return output

    def _sample(self, request_id, state, output):
        if not state.get("verifying"):
            super()._sample(request_id, state, output)

    def _verify(self, request_id: str, drafts: list[int], output: ModelRunnerOutput) -> None:
        state = self.requests[request_id]
        tokens = state["tokens"][:len(state["tokens"]) - len(drafts)]
        start = len(tokens) - 1  # its last token, computed this step with the drafts
        emitted = []
        for draft in drafts:
            token = model_token(tokens + emitted)
            emitted.append(token)
            if token != draft:
                break
        else:
            emitted.append(model_token(tokens + emitted))
        state["tokens"] = tokens + emitted
        state["computed"] = start + len(emitted)
        state["verifying"] = False
        # The scheduler freed the blocks that held only rejected drafts.
        del state["blocks"][-(-state["computed"] // self.block_size):]
        output.sampled_token_ids[request_id] = emitted

    def _propose(self, tokens: list[int]) -> list[int]:
        drafts = []
        for i in range(self.num_drafts):
            token = model_token(tokens + drafts)
            if self.wrong_every and (len(tokens) + i) % self.wrong_every == 0:
                token = (token + 1) % 500
            drafts.append(token)
        return drafts


def make_core(executor, num_blocks: int = 64, budget: int = 64, max_model_len: int = 64,
              prefix_caching: bool = True, disable_by_batch_size: int = 0,
              method: str = "ngram") -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model="fake", max_model_len=max_model_len),
        cache=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=budget,
                                  async_scheduling=True),
        speculative=SpeculativeConfig(method=method, num_speculative_tokens=3,
                                      disable_by_batch_size=disable_by_batch_size))
    return EngineCore(config, executor)


def run(core: EngineCore, on_step=None) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(10_000):
        if not core.has_work():
            return tokens
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        check_invariants(core.scheduler)
        check_no_rejected_slot_held(core)
        if on_step is not None:
            on_step(core)
    raise AssertionError("requests never finished")


def check_no_rejected_slot_held(core: EngineCore) -> None:
    """After a step, a running request holds the blocks of its computed tokens and
    no more: none that only a rejected draft was written into."""
    kv = core.scheduler.kv_cache_manager
    for request in core.scheduler.running:
        held = len(kv.req_to_blocks[request.request_id])
        assert held == -(-request.num_computed_tokens // BLOCK_SIZE), request.request_id


def request(request_id: str, prompt: list[int], max_tokens: int, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                             [EOS])


def alone(req: EngineCoreRequest, max_model_len: int = 64) -> list[int]:
    """What the request emits by itself, without drafts."""
    core = make_core(FakeKVExecutor(256, BLOCK_SIZE), num_blocks=256, method="",
                     max_model_len=max_model_len)
    core.add_request(req)
    return run(core)[req.request_id]


def test_accepted_drafts_give_what_decoding_alone_gives():
    executor = FakeSpecExecutor(128, BLOCK_SIZE, num_drafts=3, wrong_every=5)
    core = make_core(executor, num_blocks=128)
    requests = [request(f"r{i}", [5 + i, 7, 9 + 2 * i, 11], 30, ignore_eos=True)
                for i in range(4)]
    for r in requests:
        core.add_request(r)
    out = run(core)
    for r in requests:
        assert out[r.request_id] == alone(r)
    stats = core.scheduler.spec_decoding.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_accepted_tokens == sum(stats.num_accepted_tokens_per_pos)
    per_pos = stats.num_accepted_tokens_per_pos
    assert per_pos == sorted(per_pos, reverse=True)  # a draft counts only after the ones before
    assert core.scheduler.kv_cache_manager.num_free_blocks == 128
    # Fewer steps than tokens: the drafts landed.
    assert len(executor.steps) < sum(len(t) for t in out.values()) / 4 + 6


def test_drafts_stop_at_max_tokens_and_max_model_len():
    executor = FakeSpecExecutor(64, BLOCK_SIZE, num_drafts=3, wrong_every=0, max_model_len=24)
    core = make_core(executor, max_model_len=24)
    core.add_request(request("short", [5, 6, 7], 6, ignore_eos=True))
    core.add_request(request("long", [8, 9, 10, 11], 100, ignore_eos=True))
    out = run(core)  # the executor checks that no draft goes past max_model_len
    assert len(out["short"]) == 6 and len(out["long"]) == 24 - 4
    assert out["short"] == alone(request("short", [5, 6, 7], 6, ignore_eos=True), 24)
    assert out["long"] == alone(request("long", [8, 9, 10, 11], 100, ignore_eos=True), 24)


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there():
    executor = FakeSpecExecutor(64, BLOCK_SIZE, num_drafts=3, wrong_every=0)
    core = make_core(executor)
    reqs = [request(f"e{i}", [i, 2 * i + 1, 3], 40) for i in range(1, 30)]
    for r in reqs:
        core.add_request(r)
    out = run(core)
    ended_early = [r for r in reqs if out[r.request_id][-1] == EOS and len(out[r.request_id]) > 1]
    assert ended_early, "no request met EOS: the test needs one"
    for r in reqs:
        assert out[r.request_id] == alone(r)


def test_no_drafts_while_the_batch_is_large():
    executor = FakeSpecExecutor(256, BLOCK_SIZE, num_drafts=3, wrong_every=0)
    core = make_core(executor, num_blocks=256, disable_by_batch_size=4)
    for i in range(6):
        core.add_request(request(f"r{i}", [i + 1, 2, 3], 12, ignore_eos=True))
    run(core)
    for so in executor.steps:
        running = len(so.num_scheduled_tokens)
        assert not so.scheduled_spec_decode_tokens or running < 4


def test_a_request_whose_drafts_keep_failing_backs_off():
    executor = FakeSpecExecutor(64, BLOCK_SIZE, num_drafts=3, wrong_every=1)  # all wrong
    core = make_core(executor)
    core.add_request(request("r", [1, 2, 3], 60, ignore_eos=True))
    out = run(core)
    stats = core.scheduler.spec_decoding.stats
    assert stats.num_accepted_tokens == 0
    # Backing off 4, 16, then 64 steps: a few failed drafts in 60 tokens (a failure
    # is known only after the next drafts were asked for, so they come in pairs).
    assert stats.num_drafts <= 4
    assert out["r"] == alone(request("r", [1, 2, 3], 60, ignore_eos=True))


def test_drafts_never_preempt_another_request():
    # 8 blocks of 4: two requests of 14 tokens fill 8 blocks; drafts would need more.
    executor = FakeSpecExecutor(8, BLOCK_SIZE, num_drafts=3, wrong_every=0, max_model_len=16)
    core = make_core(executor, num_blocks=8, max_model_len=16, prefix_caching=False)
    reqs = [request(f"r{i}", [i + 1, 2, 3, 4, 5, 6], 10, ignore_eos=True) for i in range(2)]
    for r in reqs:
        core.add_request(r)
    out = run(core)
    assert core.scheduler.num_preemptions == 0
    for r in reqs:
        assert out[r.request_id] == alone(r, 16)


_add = st.tuples(st.just("add"), st.integers(1, 20), st.integers(1, 30), st.booleans())
operations = st.lists(st.one_of(
    _add, _add, _add,
    st.tuples(st.just("abort"), st.integers(0, 40)),
    st.tuples(st.just("step"), st.integers(1, 6)),
), min_size=6, max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, num_blocks=st.integers(12, 24), budget=st.integers(6, 48),
       wrong_every=st.integers(0, 4), prefix_caching=st.booleans(),
       disable_by_batch_size=st.sampled_from([0, 3]))
def test_random_workloads_emit_what_each_request_emits_alone(
        ops, num_blocks, budget, wrong_every, prefix_caching, disable_by_batch_size):
    executor = FakeSpecExecutor(num_blocks, BLOCK_SIZE, 3, wrong_every, max_model_len=48)
    core = make_core(executor, num_blocks, budget, 48, prefix_caching, disable_by_batch_size)
    added, aborted, out = {}, set(), {}

    def collect(outputs):
        for o in outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)

    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, eos = op
            rid = f"r{len(added)}"
            prompt = [(len(added) * 13 + j * 7) % 50 + 4 for j in range(prompt_len)]
            added[rid] = request(rid, prompt, max_tokens, ignore_eos=not eos)
            core.add_request(added[rid])
        elif op[0] == "abort" and added:
            rid = f"r{op[1] % len(added)}"
            aborted.add(rid)
            collect(core.abort_requests([rid]))
        else:
            for _ in range(op[1]):
                collect(core.step())
                check_invariants(core.scheduler)
                check_no_rejected_slot_held(core)
    tokens = run(core)
    for rid, t in tokens.items():
        out.setdefault(rid, []).extend(t)
    event(f"preempted: {core.scheduler.num_preemptions > 0}")
    event(f"drafts accepted: {core.scheduler.spec_decoding.stats.num_accepted_tokens > 0}")
    for rid, req in added.items():
        if rid not in aborted:
            assert out.get(rid) == alone(req, 48), rid
    assert core.scheduler.kv_cache_manager.num_free_blocks == num_blocks


def test_the_last_output_carries_the_requests_acceptance_for_its_span():
    executor = FakeSpecExecutor(128, BLOCK_SIZE, num_drafts=3, wrong_every=4)
    core = make_core(executor, num_blocks=128)
    for i in range(3):
        core.add_request(request(f"r{i}", [3 + i, 9, 4], 30, ignore_eos=True))
    last = {}
    while core.has_work():
        for output in core.step():
            last[output.request_id] = output
    stats = core.scheduler.spec_decoding.stats
    assert sum(o.num_accepted_tokens for o in last.values()) == stats.num_accepted_tokens
    assert sum(o.num_draft_tokens for o in last.values()) == stats.num_draft_tokens
    assert sum(o.num_drafts for o in last.values()) == stats.num_drafts
    o = last["r0"]
    back = convert.engine_core_output_from_proto(convert.engine_core_output_to_proto(o))
    assert (back.num_drafts, back.num_draft_tokens, back.num_accepted_tokens) == \
        (o.num_drafts, o.num_draft_tokens, o.num_accepted_tokens) != (0, 0, 0)
    attributes = spec_decode_attributes(o)
    assert attributes["llmserve.spec_decode.mean_acceptance_length"] == \
        1 + o.num_accepted_tokens / o.num_drafts
    stats_back = convert.engine_stats_from_proto(convert.engine_stats_to_proto(core.stats()))
    assert stats_back.spec_decode_num_accepted_tokens_per_pos == stats.num_accepted_tokens_per_pos
