"""Beam search in the scheduler, against a fake worker that keeps each KV block's
contents (tests/unit/fake_kv_executor.py): groups decode as one unit, forks share
full blocks and copy only the partial one, a shared block is never written,
preemption and abort take whole groups, and every block is free at the end.
The random property test checks that, whatever else runs, a group's beams are
those it finds alone."""
from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services.common.beam_search import BeamSearch
from services.common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from services.common.request_types import EngineCoreRequest, FinishReason, SamplingParams
from services.engine_core.engine_core import EngineCore
from services.engine_core.request import RequestStatus
from tests.unit.fake_kv_executor import EOS, FakeKVExecutor
from tests.unit.test_scheduler_properties import check_invariants

BLOCK_SIZE = 4


def make_core(num_blocks: int = 64, budget: int = 64, max_seqs: int = 32,
              prefix_caching: bool = True, policy: str = "fcfs",
              max_model_len: int = 64, async_scheduling: bool = False) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig(model="fake", max_model_len=max_model_len),
        cache=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                  policy=policy, async_scheduling=async_scheduling))
    return EngineCore(config, FakeKVExecutor(num_blocks, BLOCK_SIZE))


def beam_request(request_id: str, prompt: list[int], width: int, max_tokens: int,
                 length_penalty: float = 1.0, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                             [EOS], queue_slots=width,
                             beam_search=BeamSearch(width, length_penalty))


def run(core: EngineCore, on_step=None) -> dict[str, object]:
    """Steps until done: each request's last output."""
    last = {}
    for _ in range(10_000):
        if not core.has_work():
            return last
        for output in core.step():
            last[output.request_id] = output
        check_invariants(core.scheduler)
        if on_step is not None:
            on_step(core)
    raise AssertionError("requests never finished")


def beams_alone(request: EngineCoreRequest) -> list:
    core = make_core(num_blocks=256, max_model_len=64)
    core.add_request(request)
    return run(core)[request.request_id].beams


def assert_all_free(core: EngineCore) -> None:
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert core.executor.requests == {}, "the worker was not told every beam finished"


def test_beams_decode_together_and_are_ranked_best_first():
    core = make_core()
    steps = []

    def record(so):
        group = core.scheduler.beam_groups.get("g")
        if group is not None and so.num_scheduled_tokens:
            live = {b.request_id for b in group.beams}
            steps.append((live, live & set(so.num_scheduled_tokens)))
        return execute(so)
    execute = core.executor.execute_model
    core.executor.execute_model = record
    core.add_request(beam_request("g", [5, 6, 7, 8, 9, 10], width=4, max_tokens=10))
    output = run(core)["g"]
    assert len(steps) > 3 and all(live == scheduled for live, scheduled in steps)
    assert len(output.beams) == 4 and output.finished
    scores = [b.score for b in output.beams]
    assert scores == sorted(scores, reverse=True)
    assert len({tuple(b.token_ids) for b in output.beams}) == 4
    assert_all_free(core)


def test_forks_share_full_blocks_and_copy_only_the_partial_one():
    core = make_core()
    peak = 0

    def measure(core):
        nonlocal peak
        kv = core.scheduler.kv_cache_manager
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
    prompt = list(range(20, 38))  # 18 tokens: 4 full blocks, then a partial one
    core.add_request(beam_request("g", prompt, width=4, max_tokens=6, ignore_eos=True))
    output = run(core, measure)["g"]
    assert all(len(b.token_ids) == 6 for b in output.beams)
    blocks_per_sequence = -(-(len(prompt) + 6) // BLOCK_SIZE)
    # Unshared, 4 beams would hold 4 x 6 blocks; they share the 4 full prompt blocks.
    assert peak <= 4 + 4 * (blocks_per_sequence - 4) < 4 * blocks_per_sequence
    assert core.executor.num_copies > 0  # the fake worker checked each copy was needed
    assert_all_free(core)


def test_abort_frees_every_beam_at_once():
    core = make_core()
    core.add_request(beam_request("g", [1, 2, 3, 4, 5], width=3, max_tokens=30,
                                  ignore_eos=True))
    for _ in range(6):
        core.step()
    assert len(core.scheduler.beam_groups["g"].beams) == 3
    (output,) = core.abort_requests(["g"])
    assert output.finish_reason is FinishReason.ABORT and output.beams == []
    assert not core.scheduler.requests and not core.scheduler.beam_groups
    run(core)  # tells the worker
    assert_all_free(core)


def test_preemption_takes_and_brings_back_the_whole_group():
    request = beam_request("g", list(range(40, 50)), width=3, max_tokens=14, ignore_eos=True)
    expected = beams_alone(request)
    core = make_core(num_blocks=22)
    seen_preempted = []

    def check_whole(core):
        group = core.scheduler.beam_groups.get("g")
        if group is not None:
            statuses = {b.status for b in group.beams}
            assert len(statuses) == 1, f"a beam group half preempted: {statuses}"
            seen_preempted.append(RequestStatus.PREEMPTED in statuses)
    for i in range(3):  # older requests that grow while the beams do: the beams yield
        core.add_request(EngineCoreRequest(f"r{i}", [60 + i] * 9, SamplingParams(max_tokens=20,
                                           ignore_eos=True), [EOS]))
    core.add_request(request)
    outputs = run(core, check_whole)
    assert any(seen_preempted) and core.scheduler.num_preemptions > 0
    assert outputs["g"].beams == expected
    assert_all_free(core)


def test_a_failed_step_then_abort_frees_the_group():
    """What the engine loop does when the workers fail: the step raises, then every
    live request, a beam group whole, is aborted."""
    core = make_core()
    core.add_request(beam_request("g", [1, 2, 3, 4, 5], width=3, max_tokens=30,
                                  ignore_eos=True))
    for _ in range(4):
        core.step()
    core.executor.execute_model = lambda so: 1 / 0
    try:
        core.step()
    except ZeroDivisionError:
        pass
    core.abort_requests(["g"])
    pool = core.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks and not core.scheduler.requests


def test_a_group_survives_a_worker_restart():
    """recover_workers(): the new worker holds nothing; every beam is recomputed
    and the search goes on where it was."""
    request = beam_request("g", list(range(40, 50)), width=3, max_tokens=12, ignore_eos=True)
    expected = beams_alone(request)
    core = make_core()
    core.add_request(request)
    for _ in range(5):
        core.step()
    core.executor.requests.clear()  # a fresh worker: no state, an empty cache
    core.executor.init_kv_cache(core.executor.num_blocks)
    core.scheduler.requeue_all()
    assert run(core)["g"].beams == expected
    assert_all_free(core)


def test_a_group_that_cannot_fit_is_refused():
    core = make_core(num_blocks=16, max_model_len=64)
    try:
        core.add_request(beam_request("g", [1] * 20, width=4, max_tokens=40))
    except Exception as e:  # InvalidArgument, naming the beam width
        assert "beam_width" in str(e) and "KV blocks" in str(e)
    else:
        raise AssertionError("accepted beams that can never fit")


def test_stop_tokens_end_beams_and_finished_beams_wait_for_the_group():
    request = beam_request("g", [9, 8, 7, 6], width=3, max_tokens=25)
    core = make_core()
    core.add_request(request)
    beams = run(core)["g"].beams
    ended = [b for b in beams if b.finish_reason is FinishReason.STOP]
    assert ended  # this prompt's beams meet EOS (the fake model's token 3)
    assert all(b.token_ids[-1] == EOS and b.stop_reason is None for b in ended)
    assert len(beams) == 3
    assert_all_free(core)


_group = st.tuples(st.just("beams"), st.integers(1, 12), st.integers(1, 4), st.integers(2, 12),
                   st.sampled_from([0.0, 1.0]))
_plain = st.tuples(st.just("plain"), st.integers(4, 16), st.integers(4, 12))
operations = st.lists(st.one_of(
    _group, _group, _group, _plain, _plain,  # weighted: enough to run out of blocks
    st.tuples(st.just("abort"), st.integers(0, 20)),
    st.tuples(st.just("step"), st.integers(1, 3)),
), min_size=6, max_size=40)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, num_blocks=st.integers(12, 26), budget=st.integers(8, 40),
       prefix_caching=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
       async_scheduling=st.booleans())
def test_random_beam_groups_find_what_they_find_alone(ops, num_blocks, budget, prefix_caching,
                                                      policy, async_scheduling):
    # Async scheduling overlaps the plain requests' steps until a beam group runs.
    core = make_core(num_blocks, budget, max_seqs=16, prefix_caching=prefix_caching,
                     policy=policy, max_model_len=24, async_scheduling=async_scheduling)
    added, aborted, last = [], set(), {}

    def step():
        for output in core.step():
            last[output.request_id] = output
        check_invariants(core.scheduler)

    for op in ops:
        if op[0] in ("beams", "plain"):
            rid = f"r{len(added)}"
            prompt = [(7 * len(added) + i) % 50 + 10 for i in range(op[1])]
            request = (beam_request(rid, prompt, op[2], op[3], op[4]) if op[0] == "beams" else
                       EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=op[2]), [EOS]))
            try:
                core.add_request(request)
            except Exception:  # a group too big for this cache: refused up front
                continue
            added.append(request)
        elif op[0] == "abort" and added:
            rid = added[op[1] % len(added)].request_id
            if core.abort_requests([rid]):
                aborted.add(rid)
        else:
            for _ in range(op[1]):
                step()
    last.update(run(core))
    event(f"preempted: {core.scheduler.num_preemptions > 0}")
    event(f"copies: {core.executor.num_copies > 0}")
    assert_all_free(core)
    for request in added:
        if request.beam_search is not None and request.request_id not in aborted:
            assert last[request.request_id].beams == beams_alone(request)


def test_a_step_undone_by_a_preemption_leaves_no_stale_prefix_cache_entry():
    """A request scheduled early in a step registers, in the prefix cache, the
    blocks its tokens will fill; preempted later in the same schedule() (a beam
    group's earlier beams when the group is the victim, or any request under the
    priority policy), those tokens are never computed. Its blocks must leave the
    prefix cache, or its own recomputation reads KV nobody wrote. Found by the
    property test above; the fake worker checks every position it reads."""
    core = make_core(num_blocks=11, budget=16, policy="priority", max_model_len=24)
    core.add_request(EngineCoreRequest("r0", list(range(10, 19)), SamplingParams(
        max_tokens=8, ignore_eos=True), [EOS]))
    for request in (None, beam_request("r2", [24, 25], 3, 10),
                    beam_request("r3", [31, 32, 33, 34, 35], 3, 6)):
        if request is not None:
            core.add_request(request)
        core.step()
        core.step()
    run(core)
    assert core.scheduler.num_preemptions > 0
    assert_all_free(core)
