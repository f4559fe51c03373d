"""Ratios to transformers and vLLM-CPU, fractions of the floor, and the Markdown,
on made-up results (no model, no timing)."""
import dataclasses

import pytest

from bench import floor
from bench.floor import Measured, ModelShape
from bench.ratios import add_ratios
from bench.report import cell, to_markdown
from bench.settings import Settings

S = Settings(requests=4, large_requests=8, prompt_len=8, output_len=4, single_stream_len=6,
             concurrency=[1, 4])


def _offline(tok_s: float) -> dict:
    return {"requests": 4, "seconds": 16 / tok_s, "output_tokens": 16,
            "output_tok_s": tok_s, "total_tok_s": 3 * tok_s}


def _single(tok_s: float, itl: float) -> dict:
    return {"output_tokens": 6, "seconds": 6 / tok_s, "output_tok_s": tok_s,
            "decode_tok_s": tok_s * 1.1, "ttft_s": 0.1, "itl_p50_s": itl, "itl_p99_s": 2 * itl}


def _serving(c: int) -> dict:
    return {"load": f"concurrency {c}", "concurrency": c, "requests": 4, "output_tokens": 16,
            "seconds": 1.0, "output_tok_s": 100.0 * c, "ttft_p50_s": 0.2, "ttft_p99_s": 0.3,
            "itl_p50_s": 0.02, "itl_p99_s": 0.04, "e2e_p50_s": 0.5}


def _floor() -> dict:
    shape = ModelShape()
    ms = floor.batch_sizes(S)
    passes = {str(m): {"m": m, "seconds": 0.1 * m, "runs": 3,
                       "shapes_s": {name: 0.02 * m for name, *_ in shape.linears()}}
              for m in ms}
    result = {"dtype": "float32", "torch_threads": 2, "shape": dataclasses.asdict(shape),
              "params_per_token": shape.params(), "weight_bytes": 4 * shape.params(),
              "bytes_per_param": 4, "passes": passes,
              "gflop_s": {str(m): 10.0 * m for m in ms}, "copy_gb_s": 10.0, "gemv_gb_s": 8.0,
              "stream_gb_s": 10.0}
    result["floors"] = floor.floors(shape, Measured({m: 10.0 * m for m in ms}, 10.0, 4), S)
    return result


def make_results(vllm: str = "ran") -> dict:
    results = {
        "meta": {"command": "python -m bench", "model_name": "m", "started_at": "now",
                 "cpu": "cpu", "cores": 2, "torch": "2.13", "torch_threads": 2,
                 "transformers": "5", "omp_wait_policy": "unset", "load_before": 0.1,
                 "load_after": 0.2, "wall_s": 9.0},
        "settings": dataclasses.asdict(S), "phases": {"offline": 1.0},
        "baseline": {"hf_batched": {**_offline(50.0), "batch_size": 4},
                     "hf_batch1": {**_serving(1), "batch_size": 1, "output_tok_s": 20.0},
                     "hf_single_stream": _single(20.0, 0.05)},
        "offline": _offline(100.0), "offline_large": _offline(150.0),
        "single_stream": _single(30.0, 0.03), "serving": [_serving(1), _serving(4)],
        "floor": _floor()}
    if vllm == "ran":
        results["vllm"] = {
            "offline": _offline(200.0), "offline_large": _offline(300.0),
            "single_stream": _single(40.0, 0.025), "meta": {"dtype": "torch.float32"},
            "phases": {}, "setup": {"venv": "/v", "torch": "2.13.0+cpu", "vllm": "0.32.0",
                                    "notes": [], "log": "/v.log",
                                    "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                            "VLLM_CPU_KVCACHE_SPACE": "4"}}}
    elif vllm == "error":
        results["vllm"] = {"error": "pip install failed: no matching distribution"}
    add_ratios(results)
    return results


def test_ratios_to_vllm_are_llmserve_over_vllm():
    r = make_results()
    assert r["offline"]["ratio"]["output_tok_s"] == pytest.approx(2.0)
    assert r["offline"]["ratio_vllm"] == pytest.approx({"output_tok_s": 0.5, "total_tok_s": 0.5})
    assert r["offline_large"]["ratio_vllm"]["output_tok_s"] == pytest.approx(0.5)
    assert "ratio" not in r["offline_large"]  # transformers does not run it
    single = r["single_stream"]["ratio_vllm"]
    assert single["output_tok_s"] == pytest.approx(0.75)
    assert single["itl_p50_s"] == pytest.approx(1.2) and single["ttft_s"] == pytest.approx(1.0)


def test_serving_ratios_to_vllm():
    one, four = make_results()["serving"]
    assert one["ratio_vllm"]["output_tok_s"] == pytest.approx(100.0 / 40.0)  # single stream
    assert four["ratio_vllm"]["output_tok_s"] == pytest.approx(400.0 / 200.0)  # offline batch
    assert one["ratio_vllm"]["ttft_p99_s"] == pytest.approx(0.3 / 0.1)
    assert four["ratio_vllm"]["itl_p99_s"] == pytest.approx(0.04 / 0.05)
    assert "e2e_p50_s" not in four["ratio_vllm"] and "e2e_p50_s" in four["ratio"]


@pytest.mark.parametrize("vllm", ["skipped", "error"])
def test_without_vllm_there_is_no_vllm_ratio(vllm):
    r = make_results(vllm)
    rows = [r["offline"], r["offline_large"], r["single_stream"], *r["serving"]]
    assert not any("ratio_vllm" in row for row in rows)
    assert r["offline"]["ratio"]["output_tok_s"] == pytest.approx(2.0)
    markdown = to_markdown(r)
    assert "vLLM-CPU |" not in markdown and "× vllm" not in markdown
    assert ("--skip-vllm" in markdown) == (vllm == "skipped")
    assert ("no matching distribution" in markdown) == (vllm == "error")


def test_every_throughput_has_a_fraction_of_its_floor():
    r = make_results()
    floors = r["floor"]["floors"]
    for row, f in [(r["offline"], floors["offline"]), (r["vllm"]["offline"], floors["offline"]),
                   (r["baseline"]["hf_batched"], floors["offline"]),
                   (r["offline_large"], floors["offline_large"]),
                   (r["single_stream"], floors["single_stream"]),
                   (r["baseline"]["hf_batch1"], floors["batch1"]),
                   (r["serving"][1], floors["serving"]["4"])]:
        assert row["floor_fraction"]["output_tok_s"] == pytest.approx(
            row["output_tok_s"] / f["output_tok_s"])
    assert set(r["single_stream"]["floor_fraction"]) == {"output_tok_s", "decode_tok_s"}


def test_no_floor_no_fraction():
    r = make_results()
    del r["floor"]
    for row in (r["offline"], r["single_stream"], *r["serving"]):
        row.pop("floor_fraction", None)
    add_ratios(r)
    assert "floor_fraction" not in r["offline"]
    assert "Machine floor" not in to_markdown(r)


def test_cell_shows_both_ratios_and_the_floor_share():
    row = {"x": 10.0, "ratio": {"x": 2.0}, "ratio_vllm": {"x": 0.5}, "floor_fraction": {"x": 0.25}}
    assert cell(row, "x") == "10.0 (2.00× hf, 0.50× vllm) [25%]"
    assert cell({"x": 10.0}, "x") == "10.0"


def test_markdown_has_every_section_and_the_vllm_columns():
    markdown = to_markdown(make_results())
    for text in ("## Offline throughput: `LLM.generate`, 4 requests",
                 "## Offline throughput: `LLM.generate`, 8 requests",
                 "## Single-stream decode", "## Serving", "## vLLM-CPU baseline",
                 "## Machine floor", "## Phase times", "| figure | llmserve | transformers "
                 "batched (left padding) | vLLM-CPU | floor | floor + KV reads |",
                 "| output tok/s with KV reads |", "baseline: vLLM-CPU offline (4)",
                 "VLLM_CPU_OMP_THREADS_BIND=0-1"):
        assert text in markdown, text
    assert "| output tok/s | 100.0 (2.00× hf, 0.50× vllm) [" in markdown


def test_figures_are_set_against_the_floor_read_beside_them():
    results = make_results()
    results["single_stream"]["floor_beside"] = {  # ITL p50 30 ms
        "itl_s": 0.02, "readings_s": [0.019, 0.02, 0.024], "itl_ratio": 1.5}
    results["serving"][0]["floor_beside"] = {"itl_s": 0.02, "readings_s": [0.018, 0.022],
                                             "itl_ratio": 1.0}
    results["offline"]["floor_beside"] = {  # 100 tok/s
        "output_tok_s": 125.0, "with_kv_reads_tok_s": 110.0, "readings_tok_s": [120.0, 130.0],
        "share": 0.8, "share_with_kv_reads": 100 / 110}
    markdown = to_markdown(results)
    section_itl = results["floor"]["floors"]["single_stream"]["itl_s"]
    assert ("In process: ITL p50 30.0 ms, 1.50× the floor's per-token time read beside it "
            "(20.00 ms, the median of 3 readings around the runs, 19.00-24.00 ms); "
            f"{0.03 / section_itl:.2f}× the floor section's {section_itl * 1e3:,.2f} ms."
            ) in markdown
    assert "One stream, served: ITL p50 20.0 ms, 1.00× the floor's" in markdown
    assert markdown.count("read beside it") == 3  # not for the served row of 4 streams
    share = results["offline"]["floor_fraction"]["output_tok_s"]
    assert ("4 requests: 100.0 output tok/s, 80% of the floor read beside it (125.0 tok/s, "
            "the median of 2 readings around the run, 120.0-130.0), 91% of it with KV reads; "
            f"{share:.0%} of the floor section's.") in markdown
