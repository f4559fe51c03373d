"""What structured outputs cost the requests batched with them: offline, the same
prompts run unconstrained, and with every fourth request held to a JSON schema,
in alternation. The schema asks for more records than output_len tokens can
hold, so every request runs to output_len in both batches and they do the same
model work: what differs is the grammar's (matchers, bitmasks, masking). The
unconstrained requests' greedy outputs must not change."""
from __future__ import annotations

import statistics
import time

from bench import prompts as P
from bench.progress import Phases
from bench.report import table
from bench.settings import Settings
from services.common.structured_outputs import StructuredOutputsParams

ROUNDS = 3
CONSTRAINED_EVERY = 4
# A list of at least 100 records: longer than any output_len the bench runs.
SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "required": ["id", "name", "tags"], "additionalProperties": False,
    "properties": {"id": {"type": "integer"}, "name": {"type": "string"},
                   "tags": {"type": "array", "items": {"type": "string"}}}}}


def run_structured_outputs(s: Settings, model_dir: str, phases: Phases, results: dict) -> None:
    from bench import offline

    prompts = P.make_prompts(s.requests, s.prompt_len, P.vocab_size(model_dir), s.seed,
                             P.OFFLINE)
    with phases("structured outputs: load llmserve, compile the schema"):
        llm = offline.load_llm(model_dir, s.dtype, s.kv_cache_gib, s.max_model_len)
        offline.warm_up(llm, prompts[:4])
        compiler = llm.llm_engine.engine_core.grammar_compiler
        compiler.compile(StructuredOutputsParams(choice=["x"]))  # loads the tokenizer
        compile_s = _timed(lambda: compiler.compile(StructuredOutputsParams(json=SCHEMA)))
        cached_s = _timed(lambda: compiler.compile(StructuredOutputsParams(json=SCHEMA)))
    rows: dict[str, list[dict]] = {"unconstrained": [], "mixed": []}
    for round_ in range(ROUNDS):
        for name in rows:
            with phases(f"structured outputs {name}: {len(prompts)} requests, round {round_ + 1}"):
                rows[name].append(_run_batch(llm, prompts, s.output_len, name == "mixed"))
                phases.note = f"{rows[name][-1]['output_tok_s']:.1f} output tok/s"
    free_tokens = {name: [r["unconstrained_tokens"] for r in runs] for name, runs in rows.items()}
    off, mixed = (statistics.median(r["output_tok_s"] for r in rows[k]) for k in rows)
    results["structured_outputs"] = {
        "requests": len(prompts), "constrained": len(prompts[::CONSTRAINED_EVERY]),
        "rounds": ROUNDS, "compile_ms": 1000 * compile_s, "cached_compile_ms": 1000 * cached_s,
        "unconstrained_output_tok_s": off, "mixed_output_tok_s": mixed,
        "cost_pct": 100 * (1 - mixed / off),
        "unconstrained_outputs_unchanged": all(
            t == free_tokens["unconstrained"][0] for ts in free_tokens.values() for t in ts)}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _run_batch(llm, prompts: list[list[int]], output_len: int, mixed: bool) -> dict:
    """One LLM.generate; in a mixed batch every CONSTRAINED_EVERY-th request
    follows SCHEMA (and may end before output_len)."""
    params = [P.greedy(output_len) for _ in prompts]
    if mixed:
        for i in range(0, len(params), CONSTRAINED_EVERY):
            params[i].structured_outputs = StructuredOutputsParams(json=SCHEMA)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)  # the same work
    return {"seconds": seconds, "output_tok_s": len(prompts) * output_len / seconds,
            "unconstrained_tokens": [o.outputs[0].token_ids for i, o in enumerate(outputs)
                                     if i % CONSTRAINED_EVERY]}


def structured_outputs_section(results: dict) -> list[str]:
    row = results.get("structured_outputs")
    if not row:
        return []
    return [f"## Cost of structured outputs (offline, {row['requests']} requests)", "",
            f"The same prompts unconstrained, and with {row['constrained']} of them held to a "
            "JSON schema (a list of 100 records: every request runs to its max_tokens either "
            f"way), greedy, median of {row['rounds']} alternating rounds. The unconstrained "
            "requests' outputs were "
            f"{'identical' if row['unconstrained_outputs_unchanged'] else '**not identical**'} "
            "in every run. Schema compile: "
            f"{row['compile_ms']:.1f} ms, {row['cached_compile_ms']:.2f} ms from the cache.", "",
            *table(["batch", "output tok/s"], [
                ["unconstrained", f"{row['unconstrained_output_tok_s']:.1f}"],
                ["mixed", f"{row['mixed_output_tok_s']:.1f}"],
                ["cost", f"{row['cost_pct']:.1f}%"]]), ""]
