"""The numeric modes' accuracy arithmetic (greedy agreement, logit differences), and
the modes phase at tiny sizes on the default model (for shape, not speed)."""
import math

import pytest
import torch

from bench import modes
from bench.__main__ import parse_args, settings_from_args
from bench.accuracy import agreement, common_prefix, logit_diff
from bench.progress import Phases
from bench.ratios import add_mode_ratios
from bench.settings import Settings


def test_identical_outputs_agree_fully():
    outputs = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert agreement(outputs, [list(o) for o in outputs]) == {
        "prompts": 2, "output_len": 4, "identical": 1.0, "mean_prefix": 1.0}


def test_diverging_outputs_count_tokens_before_the_first_difference():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = [[1, 2, 0, 4], [5, 6, 7, 8], [0, 9, 9, 9]]  # later matches do not count
    result = agreement(reference, got)
    assert result["identical"] == pytest.approx(1 / 3)
    assert result["mean_prefix"] == pytest.approx((2 / 4 + 1 + 0) / 3)
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0


def test_logit_diff_of_equal_logits_is_zero():
    logits = torch.randn(2, 5, 11)
    assert logit_diff(logits, logits.clone()) == {
        "positions": 10, "max_abs_diff": 0.0, "mean_abs_diff": 0.0, "argmax_flips": 0,
        "max_flip_margin": 0.0}


def test_logit_diff_finds_the_largest_difference_and_the_flips():
    reference = torch.tensor([[[3.0, 2.9, 0.0], [0.0, 1.0, 5.0]]])  # 1 prompt, 2 positions
    got = reference.clone()
    got[0, 0, 1] = 3.1  # flips position 0's argmax from token 0 to 1: margin 3.0 - 2.9
    got[0, 1, 0] = -0.5  # largest difference, no flip
    result = logit_diff(reference, got)
    assert result["positions"] == 2 and result["argmax_flips"] == 1
    assert result["max_abs_diff"] == pytest.approx(0.5)
    assert result["mean_abs_diff"] == pytest.approx((0.2 + 0.5) / 6)
    assert result["max_flip_margin"] == pytest.approx(0.1)


def test_bf16_compute_is_a_mode_only_where_native():
    assert [n for n, _ in modes.mode_list(False)] == ["weight_dtype=bfloat16",
                                                      "kv_cache_dtype=bfloat16"]
    assert modes.mode_list(True)[-1] == ("dtype=bfloat16", {"dtype": "bfloat16"})


def test_plain_dtype_speed_is_taken_from_the_run():
    single = {"itl_p50_s": 0.03, "decode_tok_s": 33.0}
    results = {"settings": {"dtype": "float32"}, "offline": {"output_tok_s": 100.0, "requests": 4},
               "single_stream": single,
               "dtypes": {"bfloat16": {"offline": {"output_tok_s": 150.0, "requests": 4},
                                       "single_stream": single}}}
    assert modes.measured_speed(results, {"dtype": "float32"})["from"] == "main run"
    bf16 = modes.measured_speed(results, {"dtype": "bfloat16"})
    assert bf16["from"] == "dtypes.bfloat16" and bf16["output_tok_s"] == 150.0
    assert modes.measured_speed(results, {"dtype": "float32", "weight_dtype": "bfloat16"}) is None
    assert modes.measured_speed(results, {"dtype": "float16"}) is None


def test_dtypes_flag():
    s = settings_from_args(parse_args(["--dtypes", "float32,bfloat16", "--skip-modes"]))
    assert (s.dtype, s.extra_dtypes, s.skip_modes) == ("float32", ["bfloat16"], True)
    s = settings_from_args(parse_args(["--dtype", "bfloat16"]))  # the old flag: one dtype
    assert (s.dtype, s.extra_dtypes) == ("bfloat16", [])
    assert settings_from_args(parse_args([])).dtype == "float32"
    with pytest.raises(SystemExit):
        parse_args(["--dtypes", "float32,float32"])


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def test_modes_phase_at_tiny_size(model_dir, monkeypatch):
    """float32 against itself (a second load) must agree exactly: any difference in a
    mode's row is then the mode's, not the probe's."""
    monkeypatch.setattr(modes, "mode_list", lambda native: [
        ("float32 again", {"dtype": "float32"}),
        ("kv_cache_dtype=bfloat16", {"dtype": "float32", "kv_cache_dtype": "bfloat16"})])
    s = Settings(requests=3, prompt_len=8, output_len=4, single_stream_len=4, kv_cache_gib=0.02,
                 max_model_len=64, accuracy_prompts=2, accuracy_len=4)
    # A main run's float32 speed (made up): reused by both float32 loads, so only the
    # kv mode is timed.
    results: dict = {"settings": {"dtype": "float32"},
                     "offline": {"output_tok_s": 10.0, "requests": 3},
                     "single_stream": {"itl_p50_s": 0.1, "decode_tok_s": 10.0}}
    modes.run_modes(s, model_dir, Phases(), results)
    add_mode_ratios(results)
    runs = results["modes"]["runs"]
    assert list(runs) == ["float32", "float32 again", "kv_cache_dtype=bfloat16"]
    assert "accuracy" not in runs["float32"] and runs["float32"]["speed"]["from"] == "main run"
    assert runs["kv_cache_dtype=bfloat16"]["speed"]["from"] == "measured"
    again = runs["float32 again"]["accuracy"]
    assert again["agreement"]["identical"] == 1.0 and again["logits"]["max_abs_diff"] == 0.0
    kv = runs["kv_cache_dtype=bfloat16"]
    assert kv["accuracy"]["agreement"]["prompts"] == 2
    assert kv["accuracy"]["logits"]["positions"] == 2 * 8  # every prompt position
    assert _finite(kv["accuracy"]["logits"]["max_abs_diff"])
    assert all(_finite(v) and v > 0 for v in kv["speed"]["ratio_fp32"].values())
    # The kv mode's single stream ran alternating with float32's: its ratios are to
    # those runs, not to the main run's (made-up) figures; its offline one is.
    paired, ratio = kv["speed"]["paired_reference"], kv["speed"]["ratio_fp32"]
    assert set(paired) == {"itl_p50_s", "decode_tok_s"} and paired["itl_p50_s"] != 0.1
    assert ratio["itl_p50_s"] == pytest.approx(kv["speed"]["itl_p50_s"] / paired["itl_p50_s"])
    assert ratio["output_tok_s"] == pytest.approx(kv["speed"]["output_tok_s"] / 10.0)
