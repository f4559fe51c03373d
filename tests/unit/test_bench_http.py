"""The HTTP comparison's parts that need no vLLM (`make test` never builds its venv):
the client's flags, its result turned into rows (and refused when a request fell
short), the ratios, the report's section, the picture, and the CPU class."""
import json

import pytest

from bench import http_serving as H
from bench.report import write_results
from bench.report_http import PLOT_NAME, http_section
from bench.settings import MIN_LEVEL_REQUESTS, Settings
from bench.vllm_env import VllmEnv
from services.worker.cpu_info import cpu_class

S = Settings(prompt_len=8, output_len=4, http_concurrency=[1, 4])


def _raw(c: int, tok_s: float, completed: int | None = None, tokens: int | None = None) -> dict:
    """What vLLM's client returns (figures in ms), for S's sizes."""
    n = S.level_requests(c)
    return {"completed": n if completed is None else completed, "failed": 0,
            "total_output_tokens": n * S.output_len if tokens is None else tokens,
            "duration": n * S.output_len / tok_s, "output_throughput": tok_s,
            "p50_ttft_ms": 100.0 * c, "p99_ttft_ms": 150.0 * c, "p50_itl_ms": 20.0,
            "p99_itl_ms": 40.0, "p50_e2el_ms": 500.0}


def _section(tok_s: dict[str, float]) -> dict:
    section = {"levels": [1, 4], "dtype": "float32", "client": "vllm.benchmarks.serve"}
    for system, rate in tok_s.items():
        section[system] = [H.client_row(_raw(c, rate * c), c, S.level_requests(c), S.output_len)
                           for c in (1, 4)]
    H.add_http_ratios(section)
    return section


def test_client_row_is_in_seconds_and_checks_every_request():
    row = H.client_row(_raw(8, 50.0), 8, S.level_requests(8), S.output_len)
    assert row["ttft_p50_s"] == pytest.approx(0.8) and row["itl_p99_s"] == pytest.approx(0.04)
    assert row["output_tok_s"] == 50.0 and row["requests"] == 8
    with pytest.raises(RuntimeError, match="7 of 8 requests completed"):
        H.client_row(_raw(8, 50.0, completed=7), 8, 8, S.output_len)
    with pytest.raises(RuntimeError, match="with 31 tokens, not 32"):
        H.client_row(_raw(8, 50.0, tokens=31), 8, 8, S.output_len)


def test_ratios_are_llmserve_over_vllm_and_http_over_grpc():
    section = _section({"vllm": 100.0, "llmserve_http": 110.0, "llmserve_grpc": 125.0})
    http, grpc = section["llmserve_http"][1], section["llmserve_grpc"][1]
    assert http["ratio_vllm"]["output_tok_s"] == pytest.approx(1.1)
    assert grpc["ratio_vllm"]["output_tok_s"] == pytest.approx(1.25)
    assert http["ratio_vllm"]["ttft_p50_s"] == pytest.approx(1.0)
    assert http["http_vs_grpc"] == pytest.approx(110 / 125)
    assert "ratio_vllm" not in section["vllm"][0]


def test_client_flags_match_the_settings():
    argv = H.client_argv("http://h:1", "/m/SmolLM2", S, 16, warmups=2)
    flag = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    assert flag["--max-concurrency"] == "16" and flag["--num-prompts"] == "16"
    one = H.client_argv("http://h:1", "/m/SmolLM2", S, 1, warmups=2)
    # One stream still sends several requests, so that its p50s are not one request's.
    assert one[one.index("--num-prompts") + 1] == str(MIN_LEVEL_REQUESTS) != "1"
    assert flag["--random-input-len"] == "8" and flag["--random-output-len"] == "4"
    assert flag["--served-model-name"] == "SmolLM2" and flag["--num-warmups"] == "2"
    assert "--ignore-eos" in argv and flag["--temperature"] == "0"
    env = VllmEnv(venv="/v", python="/v/bin/python", torch="2.13.0", vllm="0.32.0")
    server = H.vllm_server_argv(env, S, "/m/SmolLM2", 8000)
    assert "--no-enable-prefix-caching" in server and server[:4] == [
        "/v/bin/python", "-I", "-m", "vllm.entrypoints.openai.api_server"]


def test_report_and_picture(tmp_path):
    section = _section({"vllm": 100.0, "llmserve_http": 110.0, "llmserve_grpc": 125.0})
    results = {"settings": {"prompt_len": 8, "output_len": 4},
               "meta": {"cpu_class": "AVX2", "model_name": "m", "cpu": "cpu", "cores": 2},
               "http_serving": section}
    lines = "\n".join(http_section(results))
    assert "CPU class AVX2" in lines and f"]({PLOT_NAME})" in lines
    assert "| 4 | llmserve, HTTP API | 440.0 (1.10× vllm) {0.88× gRPC} |" in lines
    write_results(results, lines, str(tmp_path))
    png = (tmp_path / PLOT_NAME).read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    assert json.loads((tmp_path / "latest.json").read_text())["http_serving"]["levels"] == [1, 4]


def test_a_failed_comparison_is_reported_without_a_picture(tmp_path):
    results = {"settings": {}, "meta": {}, "http_serving": {"error": "no venv"}}
    assert "Not measured: no venv" in "\n".join(http_section(results))
    write_results(results, "", str(tmp_path))
    assert not (tmp_path / PLOT_NAME).exists()


@pytest.mark.parametrize("flags,expected", [
    ({"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "AMX"),
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, "AVX512-BF16"),
    ({"avx2", "fma", "avx512f"}, "AVX-512"),
    ({"avx2", "fma"}, "AVX2"),
    ({"sse4_2"}, "older than AVX2")])
def test_cpu_class(flags, expected):
    assert cpu_class(flags) == expected
