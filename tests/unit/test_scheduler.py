"""Scheduler behaviour with a fake model: no weights, deterministic tokens."""
import itertools

from services.common.config import CacheConfig, SchedulerConfig
from services.common.errors import AlreadyExists, InvalidArgument
from services.common.request_types import FinishReason, SamplingParams
from services.common.scheduler_output import ModelRunnerOutput
from services.engine_core.request import Request
from services.engine_core.scheduler import Scheduler

import pytest

EOS = 0
_prompt_ranges = itertools.count(1)


def fake_token(request: Request) -> int:
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return 1 + sum(request.all_token_ids) % 97


def run_step(scheduler: Scheduler):
    so = scheduler.schedule()
    sampled = {r: [fake_token(scheduler.requests[r])] for r in so.num_scheduled_tokens
               if scheduler.requests[r].num_computed_tokens >= scheduler.requests[r].num_tokens}
    return so, scheduler.update_from_output(so, ModelRunnerOutput(sampled))


def make_scheduler(num_blocks=64, budget=64, max_seqs=8, max_model_len=256, policy="fcfs"):
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     policy=policy),
                     CacheConfig(block_size=4), max_model_len, num_blocks)


def request(rid, n_prompt, max_tokens=8, first_token=None):
    """A request whose prompt is n_prompt consecutive ids; distinct ids per request
    id by default, so that no prefix is shared unless a test asks for it."""
    first = first_token if first_token is not None else 1000 * next(_prompt_ranges)
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   frozenset({EOS}))


def drain(scheduler):
    tokens, reasons = {}, {}
    while scheduler.has_work():
        so, outputs = run_step(scheduler)
        assert so.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                reasons[o.request_id] = o.finish_reason
    return tokens, reasons


def test_new_requests_join_a_running_batch():
    s = make_scheduler()
    s.add_request(request("a", 5, max_tokens=10))
    run_step(s)
    run_step(s)
    s.add_request(request("b", 3))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 3}
    assert [r.request_id for r in so.new_requests] == ["b"]


def test_long_prompt_is_chunked_without_starving_decodes():
    s = make_scheduler(budget=16)
    s.add_request(request("decoder", 4, max_tokens=20))
    run_step(s)
    s.add_request(request("long", 50))
    chunks = []
    while s.requests["long"].num_computed_tokens < 50:
        so, _ = run_step(s)
        assert so.num_scheduled_tokens["decoder"] == 1  # the decode goes on every step
        chunks.append(so.num_scheduled_tokens["long"])
    assert chunks == [15, 15, 15, 5]


def test_preemption_under_block_pressure_gives_the_same_tokens():
    def run(num_blocks):
        s = make_scheduler(num_blocks=num_blocks, budget=256, max_model_len=64)
        for i in range(6):
            s.add_request(request(f"r{i}", 10 + i, max_tokens=30, first_token=100 * (i + 1)))
        tokens, reasons = drain(s)
        assert s.kv_cache_manager.num_free_blocks == num_blocks
        return tokens, reasons, s.num_preemptions

    roomy, roomy_reasons, none = run(200)
    tight, tight_reasons, some = run(25)
    assert none == 0 and some > 0
    assert tight == roomy and tight_reasons == roomy_reasons


def test_stop_conditions_and_abort_in_every_state():
    s = make_scheduler(num_blocks=8, max_seqs=1, max_model_len=32)
    s.add_request(request("running", 4, max_tokens=100))
    s.add_request(request("waiting", 4))
    run_step(s)
    assert s.requests["waiting"].status.value == "waiting"
    outputs = s.abort_requests(["running", "waiting", "unknown"])
    assert [(o.request_id, o.finish_reason) for o in outputs] == [
        ("running", FinishReason.ABORT), ("waiting", FinishReason.ABORT)]
    assert s.kv_cache_manager.num_free_blocks == 8 and not s.has_unfinished_requests()
    assert s.schedule().finished_request_ids == ["running", "waiting"]

    s.add_request(request("len", 4, max_tokens=3))
    _, reasons = drain(s)
    assert reasons == {"len": FinishReason.LENGTH}


def test_eos_and_stop_token_ids_finish_with_stop():
    s = make_scheduler()
    r = request("eos", 4, max_tokens=50)
    r.eos_token_ids = frozenset({fake_token(r)})  # the very first token is EOS
    s.add_request(r)
    tokens, reasons = drain(s)
    assert reasons["eos"] is FinishReason.STOP and len(tokens["eos"]) == 1

    r = request("stop", 4, max_tokens=50)
    r.sampling_params.stop_token_ids = [fake_token(r)]
    s.add_request(r)
    _, reasons = drain(s)
    assert reasons["stop"] is FinishReason.STOP


def test_admission_errors():
    s = make_scheduler(num_blocks=16, max_model_len=64)
    with pytest.raises(InvalidArgument, match="max_model_len"):
        s.add_request(request("too-long", 64))
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        make_scheduler(num_blocks=15, max_model_len=64)
    s.add_request(request("dup", 3))
    with pytest.raises(AlreadyExists):
        s.add_request(request("dup", 3))


def test_priority_policy_serves_lower_values_first_and_preempts_the_highest():
    s = make_scheduler(max_seqs=1, policy="priority")
    late_urgent = request("urgent", 4)
    s.add_request(request("background", 4))
    late_urgent.priority, late_urgent.arrival_time = -1, late_urgent.arrival_time + 1
    s.add_request(late_urgent)
    so, _ = run_step(s)
    assert list(so.num_scheduled_tokens) == ["urgent"]

    s = make_scheduler(num_blocks=12, budget=64, max_model_len=48, policy="priority")
    for rid, priority in [("p0", 0), ("p2", 2), ("p1", 1)]:
        r = request(rid, 8, max_tokens=30)
        r.priority = priority
        s.add_request(r)
    while s.num_preemptions == 0:
        run_step(s)
    assert [r.request_id for r in s.waiting] == ["p2"]
    _, reasons = drain(s)
    assert reasons == {r: FinishReason.LENGTH for r in ("p0", "p1", "p2")}


def capped_scheduler(cap):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                     max_step_tokens_while_decoding=cap),
                     CacheConfig(block_size=4), 256, 128)


def test_steps_are_capped_while_requests_decode():
    """With decodes, and no more prompts waiting than requests decoding, a step
    carries at most 10 tokens: decodes first, prompt tokens in the rest, but at
    least 10 // 4 of them."""
    capped, uncapped = capped_scheduler(10), capped_scheduler(0)
    first = {"a": (30, 100), "e": (20, 300), "f": (10, 400)}
    for s in (capped, uncapped):
        for request_id, (length, token) in first.items():
            s.add_request(request(request_id, length, max_tokens=20, first_token=token))
    so, _ = run_step(capped)
    assert so.num_scheduled_tokens == {"a": 30, "e": 20, "f": 10}  # nobody decodes yet
    run_step(uncapped)
    for s in (capped, uncapped):
        s.add_request(request("b", 40, max_tokens=4, first_token=500))
        s.add_request(request("c", 5, max_tokens=4, first_token=900))
        s.add_request(request("d", 6, max_tokens=40, first_token=700))
    outputs = {"capped": {}, "uncapped": {}}

    def step(name, s):
        so, step_outputs = run_step(s)
        for o in step_outputs:
            outputs[name].setdefault(o.request_id, []).extend(o.new_token_ids)
        return so

    decodes = {"a": 1, "e": 1, "f": 1}
    assert step("capped", capped).num_scheduled_tokens == {**decodes, "b": 7}  # 3 + 7
    assert step("uncapped", uncapped).num_scheduled_tokens == {**decodes, "b": 40, "c": 5,
                                                               "d": 6}
    prefill_grants = []
    for name, s in (("capped", capped), ("uncapped", uncapped)):
        while s.has_work():
            so = step(name, s)
            if name == "capped":
                decodes = sum(n == 1 for n in so.num_scheduled_tokens.values())
                prefill = sum(n for n in so.num_scheduled_tokens.values() if n > 1)
                assert prefill <= max(10 - decodes, 2)
                prefill_grants.append((decodes, prefill))
    # b's other 33 in steps of 7 (its last 5 with 2 of c's); then, as b and c come
    # to decode, c's last 3 with 3 of d's, and d's last 3.
    assert prefill_grants[:7] == [(3, 7)] * 5 + [(4, 6), (5, 3)]
    # The same tokens come out, only later, and every block is free again.
    assert outputs["capped"] == outputs["uncapped"] and len(outputs["capped"]) == 6
    assert capped.kv_cache_manager.num_free_blocks == 128


def test_a_burst_is_not_capped_while_more_prompts_wait_than_requests_decode():
    """The request that came first decodes alone; the 5 that came just after it are
    admitted with the whole budget, not 10 tokens a step behind its decodes. Once
    as many decode as wait, steps are capped again."""
    s = capped_scheduler(10)
    s.add_request(request("first", 8, max_tokens=30))
    run_step(s)
    for i in range(5):
        s.add_request(request(f"burst{i}", 12, max_tokens=30))
    so, _ = run_step(s)  # 1 decodes, 5 wait: the whole budget of 64
    assert so.num_scheduled_tokens == {"first": 1, **{f"burst{i}": 12 for i in range(5)}}
    for i in range(4):
        s.add_request(request(f"late{i}", 12, max_tokens=30))
    so, _ = run_step(s)  # 6 decode, 4 wait: capped at max(10 - 6, 10 // 4) prompt tokens
    assert sum(n for n in so.num_scheduled_tokens.values() if n > 1) == 4
    drain(s)
    assert s.kv_cache_manager.num_free_blocks == 128


def test_prompts_keep_a_quarter_of_a_capped_step_when_many_decode():
    s = capped_scheduler(8)
    for i in range(7):
        s.add_request(request(f"short{i}", 3, max_tokens=20, first_token=100 + i))
    run_step(s)
    s.add_request(request("long", 20, first_token=500))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {**{f"short{i}": 1 for i in range(7)}, "long": 2}
    drain(s)
    assert s.kv_cache_manager.num_free_blocks == 128


def test_n_choices_count_n_times_against_the_waiting_queue():
    """Choice i of n asks for n - i free places: a request whose choices do not all
    fit is refused at its first choice, before any of them is queued."""
    from services.common.errors import ResourceExhausted

    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64,
                                  max_waiting_requests=4), CacheConfig(block_size=4), 256, 64)
    for i, slots in enumerate((3, 2, 1)):  # n = 3 fits
        r = request(f"a-{i}", 4)
        r.queue_slots = slots
        s.add_request(r)
    first = request("b-0", 4)
    first.queue_slots = 2  # n = 2: one place is left
    with pytest.raises(ResourceExhausted, match="needs 2 places"):
        s.add_request(first)
    assert len(s.waiting) == 3
    single = request("c", 4)
    s.add_request(single)  # one place: a request with n = 1 still fits
    assert len(s.waiting) == 4
