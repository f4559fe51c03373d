"""The extra dtypes' and the numeric modes' ratios and report sections, on made-up
results (no model, no timing)."""
import copy

import pytest

from bench.ratios import add_ratios
from bench.report import to_markdown
from bench.report_modes import dtype_sections, modes_section
from tests.unit.test_bench_report import _floor, _offline, _serving, _single, make_results

BF16_HEADING = "## bfloat16: llmserve vs vLLM-CPU, same dtype"
MODES_HEADING = "## Opt-in numeric modes: speed and accuracy vs float32"


def _accuracy(identical: float, max_diff: float, flips: int) -> dict:
    return {"agreement": {"prompts": 4, "output_len": 8, "identical": identical,
                          "mean_prefix": 0.9},
            "logits": {"positions": 32, "max_abs_diff": max_diff, "mean_abs_diff": 0.01,
                       "argmax_flips": flips, "max_flip_margin": 0.05 if flips else 0.0}}


def _speed(tok_s: float, itl: float, source: str = "measured") -> dict:
    return {"output_tok_s": tok_s, "requests": 4, "itl_p50_s": itl, "decode_tok_s": 1 / itl,
            "from": source}


def with_dtypes_and_modes(vllm: str = "ran") -> dict:
    """make_results plus a bfloat16 run (vLLM ran, failed or was skipped) and modes."""
    r = make_results()
    sub = {"dtype": "bfloat16", "offline": _offline(160.0), "offline_large": _offline(240.0),
           "single_stream": _single(50.0, 0.02), "serving": [_serving(4)],
           "floor": {**_floor(), "dtype": "bfloat16"}}
    if vllm == "ran":
        sub["vllm"] = {**copy.deepcopy(r["vllm"]), "meta": {"dtype": "torch.bfloat16"}}
    elif vllm == "error":
        sub["vllm"] = {"error": "vLLM: bfloat16 is not supported here"}
    r["settings"]["extra_dtypes"] = ["bfloat16"]
    r["dtypes"] = {"bfloat16": sub}
    r["modes"] = {"prompts": 4, "output_len": 8, "logit_prompts": 4, "max_rows": 8, "runs": {
        "float32": {"args": {"dtype": "float32"}, "speed": _speed(100.0, 0.03, "main run")},
        "weight_dtype=bfloat16": {"args": {}, "speed": _speed(100.0, 0.02),
                                  "accuracy": _accuracy(1.0, 0.2, 0)},
        "kv_cache_dtype=bfloat16": {"args": {}, "error": "RuntimeError('no kernel')"},
        "dtype=bfloat16": {"args": {"dtype": "bfloat16"},
                           "speed": _speed(160.0, 0.02, "dtypes.bfloat16"),
                           "accuracy": _accuracy(0.5, 1.5, 3)}}}
    add_ratios(r)
    return r


def test_bf16_figures_are_compared_with_vllm_in_bf16():
    sub = with_dtypes_and_modes()["dtypes"]["bfloat16"]
    assert sub["offline"]["ratio_vllm"]["output_tok_s"] == pytest.approx(160.0 / 200.0)
    assert sub["offline_large"]["ratio_vllm"]["output_tok_s"] == pytest.approx(240.0 / 300.0)
    assert sub["single_stream"]["ratio_vllm"]["itl_p50_s"] == pytest.approx(0.02 / 0.025)
    floors = sub["floor"]["floors"]
    assert sub["offline"]["floor_fraction"]["output_tok_s"] == pytest.approx(
        160.0 / floors["offline"]["output_tok_s"])
    assert "floor_fraction" in sub["vllm"]["offline"] and "ratio" not in sub["offline"]
    served = sub["serving"][0]  # against vLLM's offline batch, as in the main table
    assert served["ratio_vllm"]["output_tok_s"] == pytest.approx(400.0 / 200.0)
    assert served["floor_fraction"]["output_tok_s"] == pytest.approx(
        400.0 / floors["serving"]["4"]["output_tok_s"])


def test_mode_speed_is_compared_with_float32():
    runs = with_dtypes_and_modes()["modes"]["runs"]
    assert "ratio_fp32" not in runs["float32"]["speed"]
    ratio = runs["weight_dtype=bfloat16"]["speed"]["ratio_fp32"]
    assert ratio["output_tok_s"] == pytest.approx(1.0)
    assert ratio["itl_p50_s"] == pytest.approx(0.02 / 0.03)
    assert runs["dtype=bfloat16"]["speed"]["ratio_fp32"]["output_tok_s"] == pytest.approx(1.6)


def test_bf16_section_has_llmserve_vllm_and_floor_columns():
    markdown = to_markdown(with_dtypes_and_modes())
    assert BF16_HEADING in markdown and "float32 (also bfloat16: see its section)" in markdown
    assert "| figure | llmserve | vLLM-CPU | floor |" in markdown
    assert "| offline 4: output tok/s | 160.0 (0.80× vllm) [" in markdown
    assert "| offline 8: output tok/s | 240.0 (0.80× vllm) [" in markdown
    assert "| single stream: inter-token latency p50 ms | 20.0 (0.80× vllm) |" in markdown
    assert ("| served, 4 streams (vLLM-CPU: offline): output tok/s | 400.0 (2.00× vllm) ["
            in markdown)
    assert "vLLM-CPU ran as torch.bfloat16" in markdown


@pytest.mark.parametrize("vllm", ["error", "skipped"])
def test_bf16_section_without_vllm(vllm):
    lines = dtype_sections(with_dtypes_and_modes(vllm))
    text = "\n".join(lines)
    assert BF16_HEADING in text and "× vllm" not in text
    assert "| figure | llmserve | floor |" in text
    assert ("bfloat16 is not supported here" in text) == (vllm == "error")
    assert ("--skip-vllm" in text) == (vllm == "skipped")


def test_modes_table_shows_speed_next_to_accuracy():
    text = "\n".join(modes_section(with_dtypes_and_modes()))
    assert MODES_HEADING in text and "first 4 offline prompts whose 8 greedy tokens" in text
    assert "| `float32` (reference) | 100.0 † | 33.3 † | 30.0 † | - | - | - | - | - |" in text
    assert ("| `weight_dtype=bfloat16` | 100.0 (1.00× fp32) | 50.0 (1.50× fp32) | "
            "20.0 (0.67× fp32) | 100% | 90% | 0.200 | 0.0100 | 0 of 32 (0.000) |") in text
    assert "| `dtype=bfloat16` | 160.0 (1.60× fp32) † |" in text
    assert "| 50% | 90% | 1.500 | 0.0100 | 3 of 32 (0.050) |" in text
    assert "| `kv_cache_dtype=bfloat16` | failed: `RuntimeError('no kernel')` |" in text


def test_without_extra_dtypes_or_modes_there_are_no_such_sections():
    r = make_results()
    markdown = to_markdown(r)
    assert "same dtype" not in markdown and "numeric modes" not in markdown
    assert dtype_sections(r) == [] and modes_section(r) == []
    r["settings"]["skip_modes"] = True
    assert "Skipped (`--skip-modes`)." in to_markdown(r)
