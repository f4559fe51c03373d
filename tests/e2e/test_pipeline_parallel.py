"""Pipeline parallelism through real processes: each stage a worker process (or a
TP group of them) holding only its layers, intermediate tensors passed between
stages over gloo, the engine core's batch queue keeping several batches in flight.
Greedy output equals one stage's, through the served stack and the offline API.

A tiny random Llama (4 layers, 4 heads, 2 KV heads: splittable 2 and 3 ways, and
in two by TP) with the default model's tokenizer; the offline test runs the
default model's real weights."""
import concurrent.futures
import gc
import re
import weakref
from pathlib import Path

import pytest
from transformers import LlamaConfig

from llmserve.client import Client
from llmserve.launcher import LocalStack
from llmserve.llm import LLM
from services.common.config import (CacheConfig, EngineConfig, LoRAConfig, ModelConfig,
                                    ParallelConfig, SchedulerConfig)
from services.common.sampling_params import SamplingParams
from tests.e2e.conftest import (address, engine_stats, kill_a_worker_mid_stream,
                                wait_all_blocks_free)
from tests.integration.tiny_models import tiny_hf_model, write_tiny_llama
from tests.lora_adapters import ALL_PROJECTIONS, build_adapter, peft_greedy
from tests.metrics_scrape import scrape, value

pytestmark = pytest.mark.e2e
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
           "1, 2, 3, 5, 8,"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, model_dir):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-4-layers"), model_dir,
                            num_hidden_layers=4, tie_word_embeddings=True)


def one_stage_greedy(model: str, prompts: list[str], max_tokens: int,
                     **parallel) -> list[list[int]]:
    """The offline API's greedy tokens: the reference with its worker in this
    process; with `parallel` sizes, over worker processes."""
    llm = LLM(model, dtype="float32", max_model_len=512, **parallel)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                   ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return one_stage_greedy(tiny_model_dir, PROMPTS, MAX_TOKENS)


def config(model: str, pp: int, tp: int = 1, kv_bytes: int = 16 << 20,
           max_model_len: int = 512, lora: bool = False, **scheduler):
    return EngineConfig(model=ModelConfig(model=model, dtype="float32",
                                          max_model_len=max_model_len),
                        cache=CacheConfig(kv_cache_bytes=kv_bytes),
                        scheduler=SchedulerConfig(**scheduler),
                        lora=LoRAConfig(enable_lora=lora),
                        parallel=ParallelConfig(tensor_parallel_size=tp,
                                                pipeline_parallel_size=pp))


def greedy(client: Client, prompt: str, max_tokens: int = MAX_TOKENS,
           lora_name: str | None = None) -> list[int]:
    return [t for r in client.generate(prompt, max_tokens=max_tokens, temperature=0,
                                       ignore_eos=True, lora_name=lora_name)
            for t in r.token_ids]


def stage_log_lines(log_dir: Path) -> list[tuple[int, int, int, int]]:
    """(stage, first layer, last layer, parameters) per worker, from the line each
    logs once its weights are loaded."""
    pattern = re.compile(r"pipeline stage (\d+) of \d+, layers (\d+)-(\d+), (\d+) parameters")
    return sorted(tuple(map(int, m.groups())) for path in log_dir.glob("worker*.log")
                  for m in [pattern.search(path.read_text())] if m)


@pytest.mark.parametrize("pp, tp", [(2, 1), (3, 1), (2, 2)])
def test_stages_give_one_stages_greedy_tokens(tiny_model_dir, reference, tmp_path, pp, tp):
    """Through the served stack (one by one, then all at once), and the offline API."""
    with LocalStack(config(tiny_model_dir, pp, tp), port=0, log_dir=str(tmp_path)) as stack:
        stack.start(timeout_s=180)
        assert sum(s.name.startswith("worker") for s in stack.services) == pp * tp
        with Client(address(stack, "frontend")) as client:
            assert [greedy(client, p) for p in PROMPTS] == reference
            # All at once: batches of several requests in flight in the pipeline.
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
                assert list(pool.map(lambda p: greedy(client, p), PROMPTS)) == reference
        wait_all_blocks_free(stack)
    assert one_stage_greedy(tiny_model_dir, PROMPTS, MAX_TOKENS, pipeline_parallel_size=pp,
                            tensor_parallel_size=tp) == reference
    stages = stage_log_lines(tmp_path)
    assert len(stages) == pp * tp
    layers = {(s, first, last) for s, first, last, _ in stages}
    expected = {2: {(1, 0, 1), (2, 2, 3)}, 3: {(1, 0, 0), (2, 1, 2), (3, 3, 3)}}[pp]
    assert layers == expected  # vLLM's partition of 4 layers
    # Measured from the loaded parameters: each rank holds less than the model, and
    # the stages together hold it once, with the tied head's second copy (the last
    # stage has no embedding to share it with).
    model_config = LlamaConfig.from_pretrained(tiny_model_dir)
    whole = sum(p.numel() for p in tiny_hf_model(model_config).parameters())
    assert all(n < whole for *_, n in stages)
    if tp == 1:
        head = model_config.vocab_size * model_config.hidden_size
        assert sum(n for *_, n in stages) == whole + head


def sampled_choices(client: Client, prompt: str, params: SamplingParams) -> list[list[int]]:
    """Each choice's tokens, by index."""
    choices: dict[int, list[int]] = {}
    for r in client.generate(prompt, sampling=params):
        choices.setdefault(r.index, []).extend(r.token_ids)
    return [choices[i] for i in sorted(choices)]


def test_lora_structured_outputs_n_and_stop_strings_across_stages(tiny_model_dir, tokenizer,
                                                                   tmp_path):
    """Each stage applies the adapter's weights for its own layers only (equal to
    peft); a structured-outputs request's bitmask reaches the last stage, n = 2
    seeded choices sample as in one stage, and a stop string cuts a stream as in
    one stage, all at once with batches in flight."""
    from services.common.sampling_params import OutputKind
    from services.common.structured_outputs import StructuredOutputsParams

    constrained = SamplingParams(temperature=0, max_tokens=8, output_kind=OutputKind.DELTA,
                                 structured_outputs=StructuredOutputsParams(
                                     choice=["yes", "no", "maybe"]))
    seeded = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True,
                            output_kind=OutputKind.DELTA)
    llm = LLM(tiny_model_dir, dtype="float32", max_model_len=512)
    free = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    stopped = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             stop=[text[len(text) // 2:len(text) // 2 + 4]],
                             output_kind=OutputKind.DELTA)
    outputs = llm.generate(PROMPTS[:3], [constrained, seeded, stopped], use_tqdm=False)
    expected = [[list(c.token_ids) for c in o.outputs] for o in outputs]
    assert outputs[2].outputs[0].finish_reason == "stop"
    assert len(expected[2][0]) < len(free[0].outputs[0].token_ids)
    del llm
    lora_dir = str(tmp_path / "adapter")
    build_adapter(tiny_model_dir, lora_dir, 5, r=8, lora_alpha=16,
                  target_modules=ALL_PROJECTIONS)
    with LocalStack(config(tiny_model_dir, 2, lora=True), port=0, log_dir=str(tmp_path),
                    lora_modules=[f"tiny-adapter={lora_dir}"]) as stack:
        stack.start(timeout_s=180)
        with Client(address(stack, "frontend")) as client:
            with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) + 3) as pool:
                others = [pool.submit(sampled_choices, client, PROMPTS[0], constrained),
                          pool.submit(sampled_choices, client, PROMPTS[1], seeded),
                          pool.submit(sampled_choices, client, PROMPTS[2], stopped)]
                got = list(pool.map(lambda p: greedy(client, p, lora_name="tiny-adapter"),
                                    PROMPTS))
                assert [f.result() for f in others] == expected
        wait_all_blocks_free(stack)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert got == peft_greedy(tiny_model_dir, lora_dir, prompts, MAX_TOKENS)
    assert tokenizer.decode(expected[0][0], skip_special_tokens=True) in ("yes", "no", "maybe")


def test_the_batch_queue_holds_batches_through_aborts_and_preemption(tiny_model_dir,
                                                                     tmp_path):
    """Two stages, a KV cache too small for every stream at once, 8 concurrent
    streams of which two are cancelled mid-way: the others equal one stage's
    tokens, the engine core's metrics show two batches in flight and preemptions,
    and every block is free at the end."""
    prompts = [f"{i}: {p}" for i in range(2) for p in PROMPTS]
    expected = one_stage_greedy(tiny_model_dir, prompts, 48)
    # 128 KiB: 8 blocks of 16 tokens on a stage of 2 layers, for 8 streams of ~60.
    stack_config = config(tiny_model_dir, 2, kv_bytes=128 << 10, max_model_len=128,
                          max_num_batched_tokens=64)
    with LocalStack(stack_config, port=0, log_dir=str(tmp_path), metrics_port=0) as stack:
        stack.start(timeout_s=180)
        with Client(address(stack, "frontend")) as client:
            def run(i):
                stream = client.generate(prompts[i], max_tokens=48, temperature=0,
                                         ignore_eos=True)
                tokens = []
                for response in stream:
                    tokens += response.token_ids
                    if i in (1, 6) and len(tokens) >= 5:
                        stream.cancel()
                        return None
                return tokens

            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(run, range(len(prompts))))
        wait_all_blocks_free(stack)
        samples = scrape(stack.metrics_addresses["engine-core"])
        assert engine_stats(stack).num_preemptions_total > 0
        for rank in (0, 1):  # each stage's forward time, and which stage a rank is
            worker = scrape(stack.metrics_addresses[f"worker-rank{rank}"])
            info = next(dict(ls) for (n, ls) in worker if n == "llmserve:worker_info")
            assert info["pipeline_stage"] == str(rank) and info["world_size"] == "2"
            assert value(worker, "llmserve:worker_forward_time_seconds_count") > 0
            waited = value(worker, "llmserve:worker_pipeline_wait_seconds_total")
            assert waited > 0 if rank else waited == 0  # only a later stage waits
    for i, tokens in enumerate(got):
        assert tokens == (None if i in (1, 6) else expected[i]), i
    depth = {le: value(samples, "llmserve:batch_queue_depth_bucket", le=le)
             for le in ("1.0", "2.0")}
    assert depth["2.0"] > depth["1.0"] > 0  # steps sent with another already in flight


def test_a_stage_killed_mid_stream_loses_nothing(tiny_model_dir, tmp_path):
    """SIGKILL of the second stage's process: the launcher restarts both stages
    together, the engine core reloads them and recomputes the request, and the
    stream ends with the undisturbed run's tokens."""
    with LocalStack(config(tiny_model_dir, 2), port=0, log_dir=str(tmp_path),
                    restart_dead=True) as stack:
        stack.start(timeout_s=180)
        kill_a_worker_mid_stream(stack, PROMPTS[0], 200)


def test_the_offline_api_splits_the_default_model_into_two_stages(model_dir, hf_model,
                                                                  tokenizer, capfd):
    """LLM(pipeline_parallel_size=2) starts a worker process per stage (15 of the
    default model's 30 layers each) and gives the one-stage greedy tokens; beam
    search, whose forks each stage copies for its own layers, gives transformers'
    beams. Dropped, it ends its step streams before it stops the workers, so they
    stop without cutting a call (which gRPC logs at ERROR)."""
    from llmserve.sampling_params import BeamSearchParams
    from tests.integration.test_beam_search import hf_beams

    prompts = PROMPTS[:2]
    llm = LLM(model_dir, dtype="float32", max_model_len=512, pipeline_parallel_size=2)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.engine_core.queue_depth() == 2
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    beams = llm.beam_search([{"prompt_token_ids": p} for p in prompt_ids],
                            BeamSearchParams(beam_width=3, max_tokens=8))
    for ids, output in zip(prompt_ids, beams):
        assert all(s.finish_reason == "length" for s in output.sequences)
        assert [s.tokens[len(ids):] for s in output.sequences] == hf_beams(hf_model, ids, 3, 8)
    core = weakref.ref(llm.llm_engine.engine_core)
    del llm
    gc.collect()
    assert core() is None
    workers_log = capfd.readouterr().err
    assert workers_log.count("llmserve.worker.v1.Worker stopped") == 2, workers_log
    assert " ERROR " not in workers_log, workers_log
    assert [list(o.outputs[0].token_ids) for o in outputs] == one_stage_greedy(
        model_dir, prompts, MAX_TOKENS)
