"""The machine floor's arithmetic (and a tiny measurement, for shape, not speed)."""
import json
import math
import statistics

import pytest
import torch

from bench import floor, floor_beside
from bench import floor_measure as fm
from bench.floor import Measured, ModelShape
from bench.settings import Settings
from services.worker.cpu_matmul.amx import amx_available
from services.worker.cpu_matmul.gemm import packed_gemm_available
from services.worker.cpu_matmul.onednn import onednn_native

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 30,
           "vocab_size": 49152}


def test_default_shape_is_the_default_models_linears(tmp_path):
    shape = ModelShape()
    assert shape.linears() == [("qkv", 576, 960, 30), ("o", 576, 576, 30),
                               ("gate_up", 576, 3072, 30), ("down", 1536, 576, 30),
                               ("lm_head", 576, 49152, 1)]
    body = 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)
    assert shape.params(with_head=False) == body
    assert shape.params() == body + 576 * 49152
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    assert ModelShape.from_model_dir(str(tmp_path)) == shape


def test_head_dim_defaults_to_hidden_over_heads(tmp_path):
    config = {k: v for k, v in SMOLLM2.items() if k not in ("head_dim", "num_key_value_heads")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.from_model_dir(str(tmp_path))
    assert shape.head_dim == 64 and shape.kv_heads == 9


def test_rate_is_the_best_measured_at_or_below_m():
    m = Measured(gflop_s={1: 5.0, 8: 40.0, 64: 100.0, 256: 80.0}, stream_gb_s=10.0,
                 bytes_per_param=4)
    assert [m.rate(x) for x in (1, 8, 63, 64, 256, 1000)] == [5.0, 40.0, 40.0, 100.0, 100.0,
                                                              100.0]


# A toy model: 1 layer of 2x2 linears and a 2x4 head, so every number is checkable by hand.
TOY = ModelShape(hidden=2, intermediate=2, heads=1, kv_heads=1, head_dim=2, layers=1, vocab=4)
TOY_M = Measured(gflop_s={1: 1.0, 2: 2.0, 4: 4.0}, stream_gb_s=1.0, bytes_per_param=4)


def test_toy_shape_params():
    # qkv 2x6, o 2x2, gate_up 2x4, down 2x2 = 12 + 4 + 8 + 4 = 28; head 2x4 = 8.
    assert TOY.params(with_head=False) == 28 and TOY.params() == 36


def test_decode_is_gemm_bound_in_batches_and_weight_bound_alone():
    # batch 4: 10 tokens x 2 FLOPs x 36 params at 4 GFLOP/s.
    assert floor.decode_seconds(TOY, TOY_M, 10, 4) == pytest.approx(10 * 72 / 4e9)
    # one stream: each token reads 36 params x 4 bytes at 1 GB/s.
    assert floor.decode_seconds(TOY, TOY_M, 10, 1) == pytest.approx(10 * 144 / 1e9)


def test_workload_floor_adds_prefill_through_the_body_only():
    f = floor.workload_floor(TOY, TOY_M, requests=2, prompt_len=3, output_len=5, batch=2)
    # prefill: 6 tokens x 2 x 28 at the rate of min(256, 6) rows (best <= 6: 4 GFLOP/s);
    # decode: 10 tokens x 2 x 36 at 2 GFLOP/s.
    seconds = 6 * 56 / 4e9 + 10 * 72 / 2e9
    assert f["seconds"] == pytest.approx(seconds)
    assert f["output_tok_s"] == pytest.approx(10 / seconds)
    assert f["total_tok_s"] == pytest.approx(16 / seconds)
    assert "itl_s" not in f


def test_kv_reads_are_every_cached_token_once_per_decode_step():
    # TOY keeps 2 (K, V) x 1 layer x 1 head x 2 dims = 4 values a token, 16 bytes.
    assert TOY.kv_values_per_token() == 4
    assert ModelShape().kv_values_per_token() == 2 * 30 * 3 * 64
    # 2 requests, prompt 3, 5 outputs: the first output comes from the prefill; the
    # 4 decode steps attend to 4, 5, 6, 7 cached tokens: 22 tokens a request.
    seconds = floor.kv_read_seconds(TOY, TOY_M, requests=2, prompt_len=3, output_len=5)
    assert seconds == pytest.approx(2 * 22 * 16 / 1e9)
    assert floor.kv_read_seconds(TOY, TOY_M, requests=2, prompt_len=3, output_len=1) == 0
    f = floor.workload_floor(TOY, TOY_M, requests=2, prompt_len=3, output_len=5, batch=2)
    assert f["with_kv_reads"]["seconds"] == pytest.approx(f["seconds"] + seconds)
    assert f["with_kv_reads"]["output_tok_s"] == pytest.approx(10 / (f["seconds"] + seconds))
    assert f["with_kv_reads"]["total_tok_s"] == pytest.approx(16 / (f["seconds"] + seconds))


def test_embedding_floor_is_the_prompts_through_the_body_at_the_prefill_rate():
    f = floor.embed_floor(TOY, TOY_M, requests=2, prompt_len=3)
    # 6 tokens x 2 x 28 body params at the best rate at or below M=6 (4 GFLOP/s); no LM head.
    assert f["seconds"] == pytest.approx(6 * 56 / 4e9)
    assert f["prompts_s"] == pytest.approx(2 / f["seconds"])
    assert f["tok_s"] == pytest.approx(6 / f["seconds"])


def test_single_stream_floor_has_a_per_token_time():
    f = floor.workload_floor(TOY, TOY_M, requests=1, prompt_len=3, output_len=5, batch=1)
    assert f["itl_s"] == pytest.approx(144 / 1e9)
    assert f["decode_tok_s"] == pytest.approx(1e9 / 144)
    # prefill of 3 rows at the best rate at or below M=3 (2 GFLOP/s).
    assert f["seconds"] == pytest.approx(3 * 56 / 2e9 + 5 * 144 / 1e9)


def test_floors_cover_every_workload_of_the_settings():
    s = Settings(requests=2, large_requests=4, prompt_len=3, output_len=5,
                 single_stream_len=6, concurrency=[1, 2], serving_requests=2, embed_requests=5)
    assert floor.batch_sizes(s) == [1, 2, 3, 4, 6, 15]  # 15: the embedding prompts' rows
    out = floor.floors(TOY, Measured(gflop_s={m: float(m) for m in floor.batch_sizes(s)},
                                     stream_gb_s=1.0, bytes_per_param=4), s)
    assert set(out) == {"offline", "offline_large", "single_stream", "batch1", "serving",
                        "embeddings"}
    assert set(out["serving"]) == {"1", "2"}
    assert out["serving"]["2"] == out["offline"]  # same requests, same batch
    assert all(math.isfinite(f["output_tok_s"]) and f["output_tok_s"] > 0
               for f in [*(out[k] for k in ("offline", "offline_large", "single_stream")),
                         *out["serving"].values()])


def test_stream_rate_is_the_faster_of_copy_and_gemv():
    assert floor.stream_rate({"copy_gb_s": 10.0, "gemv_gb_s": 20.0}) == 20.0
    assert floor.stream_rate({"copy_gb_s": 10.0, "gemv_gb_s": 5.0}) == 10.0


def test_measure_reports_every_m_and_json_round_trips():
    result = floor.measure(TOY, "float32", [1, 2])
    result = json.loads(json.dumps(result))
    assert set(result["passes"]) == set(result["gflop_s"]) == {"1", "2"}
    assert set(result["passes"]["2"]["shapes_s"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
    assert result["weight_bytes"] == 36 * 4
    assert result["copy_gb_s"] > 0 and result["gemv_gb_s"] > 0
    assert floor.measured_from(result).gflop_s.keys() == {1, 2}
    # Every GEMM path here was timed (our GEMV where it takes the shapes); the
    # fastest pass counts.
    assert result["paths"][0] == "F.linear" and "oneDNN prepacked" in result["paths"]
    assert (fm.PACKED_GEMM_PATH in result["paths"]) == packed_gemm_available()
    one = result["passes"]["2"]
    assert set(one["path_seconds"]) == set(result["paths"]) - {fm.GEMV_PATH}
    assert one["seconds"] == min(one["path_seconds"].values())
    assert one["path_seconds"][one["path"]] == one["seconds"]


def test_bf16_on_amx_times_our_amx_kernel_too():
    """The engine runs a bf16 model's decode steps through our AMX kernel there, so
    the floor must know it: else a share of it overstates how near we are."""
    if not onednn_native(torch.bfloat16):
        pytest.skip("oneDNN does not compute bf16 natively here")
    shape = ModelShape(hidden=64, intermediate=96, heads=2, kv_heads=1, head_dim=32, layers=1,
                       vocab=40)  # the head (40 columns) does not fill the kernel's blocks
    result = floor.measure(shape, "bfloat16", [3, 40])
    assert (fm.AMX_PATH in result["paths"]) == amx_available()
    if amx_available():
        assert fm.AMX_PATH in result["passes"]["40"]["path_seconds"]
        weight = torch.randn(64, 96, dtype=torch.bfloat16)
        x = torch.randn(5, 96, dtype=torch.bfloat16)
        torch.testing.assert_close(fm.amx_kernel(weight)(x), x @ weight.T, rtol=2e-2, atol=2e-2)


def test_our_gemv_is_timed_for_the_rows_it_takes():
    shape = ModelShape(hidden=16, intermediate=32, heads=1, kv_heads=1, head_dim=16, layers=1,
                       vocab=8)
    result = floor.measure(shape, "float32", [1, 9])
    assert fm.GEMV_PATH in result["passes"]["1"]["path_seconds"]
    assert fm.GEMV_PATH not in result["passes"]["9"]["path_seconds"]  # over GEMV_MAX_ROWS


def test_no_larger_run_no_larger_floor():
    s = Settings(requests=2, large_requests=0, prompt_len=3, output_len=5, concurrency=[1],
                 embed_requests=0)
    assert 0 not in floor.batch_sizes(s)
    out = floor.floors(TOY, Measured({m: 1.0 for m in floor.batch_sizes(s)}, 1.0, 4), s)
    assert "offline_large" not in out and "embeddings" not in out


def test_the_floor_is_read_again_around_the_runs(tmp_path, monkeypatch):
    config = {**SMOLLM2, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 16, "num_hidden_layers": 2,
              "vocab_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = ModelShape.from_model_dir(str(tmp_path))
    result = json.loads(json.dumps(floor.measure(shape, "float32", [1, 2, 4])))
    floors = floor_beside.FloorBeside.of(str(tmp_path), result, most_rows=2)
    assert floors.ms == [1, 2]  # the floor section's row counts the runs need
    order = []
    runs = [lambda i=i: order.append(i) or {"itl_p50_s": 0.002 * (i + 1)} for i in range(3)]
    outs, readings = floor_beside.runs_beside(floors, runs)
    assert order == [0, 1, 2] and [o["itl_p50_s"] for o in outs] == [0.002, 0.004, 0.006]
    # Read before the first run, between runs and after the last, at every row count.
    assert len(readings) == 4 and all(set(m.gflop_s) == {1, 2} for m in readings)
    assert all(positive_finite(v) for m in readings for v in [*m.gflop_s.values(),
                                                              m.stream_gb_s])
    _, ones = floor_beside.runs_beside(floors, runs[:1], ms=[1])
    assert [set(m.gflop_s) for m in ones] == [{1}, {1}]

    # The one-stream floor of each reading, as the floor section's.
    row = {"itl_p50_s": 0.004}
    floor_beside.add_itl_to_floor(row, floors, readings)
    per_token = [floor.decode_seconds(shape, m, 1, 1) for m in readings]
    assert row["floor_beside"]["readings_s"] == per_token
    assert row["floor_beside"]["itl_s"] == statistics.median(per_token)
    assert row["floor_beside"]["itl_ratio"] == pytest.approx(0.004 / statistics.median(per_token))
    # A batch's floor, with and without KV reads.
    row = {"requests": 2, "output_tok_s": 10.0}
    floor_beside.add_share_of_floor(row, floors, readings[:2], prompt_len=3, output_len=5)
    each = [floor.workload_floor(shape, m, 2, 3, 5, 2) for m in readings[:2]]
    tok_s = statistics.median(f["output_tok_s"] for f in each)
    assert row["floor_beside"]["share"] == pytest.approx(10.0 / tok_s)
    assert row["floor_beside"]["share_with_kv_reads"] > row["floor_beside"]["share"]

    # The weight stream is the faster of the copy and the one-row pass, as the floor's.
    monkeypatch.setattr(fm, "copy_bandwidth", lambda nbytes: 1e9)  # GB/s: the copy wins
    assert floors.read([1]).stream_gb_s == 1e9
    monkeypatch.setattr(fm, "copy_bandwidth", lambda nbytes: 1e-9)  # the pass wins
    one = floors.read([1])
    assert one.stream_gb_s == pytest.approx(one.gflop_s[1] * 1e9 * 4 / (2 * 1e9))

    # No floor section (--skip-floor): the runs alone, and nothing added.
    assert floor_beside.FloorBeside.of(str(tmp_path), None, 2) is None
    outs, readings = floor_beside.runs_beside(None, runs)
    assert readings is None and len(outs) == 3
    row = {"itl_p50_s": 0.004, "requests": 2, "output_tok_s": 10.0}
    floor_beside.add_itl_to_floor(row, None, None)
    floor_beside.add_share_of_floor(row, None, None, 3, 5)
    assert "floor_beside" not in row


def positive_finite(x: float) -> bool:
    return math.isfinite(x) and x > 0
