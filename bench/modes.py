"""The opt-in numeric modes, each measured for speed (offline throughput, single
stream) next to its accuracy against float32 (bench/accuracy.py), on the
benchmark's own prompts; into results["modes"]."""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass

from bench import offline
from bench import prompts as P
from bench.accuracy import LOGIT_PROMPTS, Probe, compare, probe
from bench.metrics import median_summary
from bench.machine import bf16_native
from bench.progress import Phases
from bench.settings import Settings
from llmserve.llm import LLM
from services.worker.cpu_matmul import weight_dtype_max_rows

REFERENCE = "float32"
REFERENCE_ARGS = {"dtype": "float32"}
# The single-stream figures a measured mode is compared on with float32's from
# the same alternating runs (measure_speed).
PAIRED_KEYS = ("decode_tok_s", "itl_p50_s")


def mode_list(native_bf16: bool) -> list[tuple[str, dict]]:
    """(name, LLM keyword arguments) of every mode; bf16 compute only where native
    (emulated it is many times slower, so no one would opt into it)."""
    modes = [("weight_dtype=bfloat16", {"dtype": "float32", "weight_dtype": "bfloat16"}),
             ("kv_cache_dtype=bfloat16", {"dtype": "float32", "kv_cache_dtype": "bfloat16"})]
    if native_bf16:
        modes.append(("dtype=bfloat16", {"dtype": "bfloat16"}))
    return modes


def speed_row(offline_row: dict, single: dict, source: str) -> dict:
    """The figures the modes table shows, from an offline and a single-stream row."""
    return {"output_tok_s": offline_row["output_tok_s"], "requests": offline_row["requests"],
            "itl_p50_s": single["itl_p50_s"], "decode_tok_s": single["decode_tok_s"],
            "from": source}


def measured_speed(results: dict, args: dict) -> dict | None:
    """The mode's speed if this run has measured it already: a plain dtype run."""
    if set(args) != {"dtype"}:
        return None
    dtype = args["dtype"]
    if results["settings"]["dtype"] == dtype and "offline" in results:
        return speed_row(results["offline"], results["single_stream"], "main run")
    sub = results.get("dtypes", {}).get(dtype, {})
    if "offline" in sub:
        return speed_row(sub["offline"], sub["single_stream"], f"dtypes.{dtype}")
    return None


def measure_speed(llm: LLM, reference_llm: LLM | None, s: Settings, vocab: int) -> dict:
    """Offline throughput, and the single stream in runs alternating with the float32
    reference's (when given) on the same prompts: the machine's speed swings by
    10-20% between sections of a run, more than a mode changes a single stream."""
    offline.warm_up(llm, P.make_prompts(4, s.prompt_len, vocab, s.seed, P.WARMUP))
    row = offline.run_offline(
        llm, P.make_prompts(s.requests, s.prompt_len, vocab, s.seed, P.OFFLINE), s.output_len)
    runs: dict[str, list[dict]] = {"mode": [], "reference": []}
    for prompt in P.make_prompts(s.single_stream_runs, s.prompt_len, vocab, s.seed,
                                 P.SINGLE_STREAM):
        for key, engine in (("mode", llm), ("reference", reference_llm)):
            if engine is not None:
                runs[key].append(offline.run_single_stream(engine, prompt, s.single_stream_len))
    speed = speed_row(row, median_summary(runs["mode"]), "measured")
    if runs["reference"]:
        reference = median_summary(runs["reference"])
        speed["paired_reference"] = {key: reference[key] for key in PAIRED_KEYS}
    return speed


@dataclass
class Reference:
    """The float32 run the modes are compared with: its probe, and its engine for the
    single-stream runs a measured mode alternates with."""

    probe: Probe
    llm: LLM


def run_one(s: Settings, model_dir: str, phases: Phases, results: dict, name: str,
            args: dict, reference: Reference | None) -> tuple[dict, Reference]:
    """Loads the mode, probes its accuracy (unless it is the reference), and measures
    its speed unless the run already has it. Returns the row and the mode as a
    Reference (what the float32 run becomes)."""
    vocab = P.vocab_size(model_dir)
    # The offline set drawn longer has the offline prompts as its first rows.
    prompts = P.make_prompts(s.accuracy_prompts, s.prompt_len, vocab, s.seed, P.OFFLINE)
    with phases(f"modes: {name}: load, greedy and logits probe"):
        llm = offline.load_llm(model_dir, kv_cache_gib=s.kv_cache_gib,
                               max_model_len=s.max_model_len, **args)
        got = probe(llm, prompts, s.accuracy_len)
        row: dict = {"args": args}
        if reference is not None:
            row["accuracy"] = compare(reference.probe, got)
            phases.note = (f"{row['accuracy']['agreement']['identical']:.0%} identical, max "
                           f"|dlogit| {row['accuracy']['logits']['max_abs_diff']:.3g}")
    row["speed"] = measured_speed(results, args)
    if row["speed"] is None:
        with phases(f"modes: {name}: offline {s.requests} requests, single stream"):
            row["speed"] = measure_speed(llm, reference and reference.llm, s, vocab)
            phases.note = f"{row['speed']['output_tok_s']:.1f} output tok/s"
    return row, Reference(got, llm)


def run_modes(s: Settings, model_dir: str, phases: Phases, results: dict) -> None:
    """The float32 reference, then every mode; a mode that fails is reported, not fatal."""
    runs: dict[str, dict] = {}
    results["modes"] = {"prompts": s.accuracy_prompts, "output_len": s.accuracy_len,
                        "logit_prompts": min(LOGIT_PROMPTS, s.accuracy_prompts),
                        "max_rows": weight_dtype_max_rows(), "runs": runs}
    reference = None
    for name, args in [(REFERENCE, REFERENCE_ARGS), *mode_list(bf16_native())]:
        try:
            runs[name], mode = run_one(s, model_dir, phases, results, name, args, reference)
            if reference is None:
                reference = mode
        except Exception as e:  # one broken mode must not cost the others or the run
            runs[name] = {"args": args, "error": repr(e)}
            print(f"[bench] mode {name} failed: {e!r}", file=sys.stderr, flush=True)
            if reference is None:
                return  # without the float32 reference no accuracy can be measured
        gc.collect()  # drop one mode's model before the next loads
