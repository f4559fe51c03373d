"""The pipeline-parallel section of the bench on made-up figures (the harness test
runs it at a tiny size, worker processes and metrics included)."""
from bench.pipeline import pipeline_section


def test_the_section_shows_each_variant_and_each_stages_idle_share():
    rows = [{"label": "PP=1: one worker, every core", "stages": 1, "batch_queue": True,
             "output_tok_s": 250.0, "itl_p50_s": 0.0234, "ttft_s": 0.19, "stage_idle": []},
            {"label": "PP=2: a core per stage", "stages": 2, "batch_queue": True,
             "output_tok_s": 200.0, "itl_p50_s": 0.05, "ttft_s": 0.3,
             "stage_idle": [0.12, 0.08]}]
    results = {"settings": {"prompt_len": 128, "output_len": 128, "single_stream_len": 256},
               "pipeline": {"requests": 64, "dtype": "float32", "rows": rows}}
    text = "\n".join(pipeline_section(results))
    assert "## Pipeline parallelism: offline, 64 requests × 128 prompt + 128 output" in text
    assert "| PP=1: one worker, every core | 250.0 | 23.4 | 190.0 | - |" in text
    assert "| PP=2: a core per stage | 200.0 | 50.0 | 300.0 | 12%, 8% |" in text
    assert pipeline_section({}) == []
