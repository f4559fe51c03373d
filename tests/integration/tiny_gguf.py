"""Writes a transformers model to an F32 GGUF file the way llama.cpp's
convert_hf_to_gguf.py does: its metadata keys, tensor names and q/k permutation."""
from __future__ import annotations

import numpy as np
import torch
from gguf import (MODEL_ARCH, MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, LlamaFileType,
                  RopeScalingType, TokenType, get_tensor_name_map)
from transformers.convert_slow_tokenizer import bytes_to_unicode

_ARCHS = {"llama": MODEL_ARCH.LLAMA, "mistral": MODEL_ARCH.LLAMA,
          "qwen2": MODEL_ARCH.QWEN2, "qwen3": MODEL_ARCH.QWEN3}


def _permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rope's rotate-half pairs -> interleaved pairs."""
    if n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def _write_metadata(writer: GGUFWriter, config) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # llama.cpp stores Mistral as "llama"; only the name tells them apart.
    writer.add_name("tiny-mistral" if config.model_type == "mistral" else "tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(LlamaFileType.ALL_F32)
    _write_rope_scaling(writer, config.rope_parameters)


def _write_rope_scaling(writer: GGUFWriter, rope: dict) -> None:
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope["rope_type"] != "default":
        raise ValueError(f"no GGUF form for rope type {rope['rope_type']!r} here")


def _tensors(model: torch.nn.Module, arch: MODEL_ARCH):
    """(GGUF name, F32 array) for every tensor llama.cpp would write."""
    config = model.config
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        base, suffix = hf_name.rsplit(".", 1)
        data = tensor.detach().float().numpy()
        if arch == MODEL_ARCH.LLAMA and base.endswith(("q_proj", "k_proj")):
            n_kv = config.num_attention_heads if base.endswith("q_proj") else \
                config.num_key_value_heads
            data = _permute(data, config.num_attention_heads, n_kv)
        yield f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(data)


# A byte-level BPE tokenizer as llama.cpp stores SmolLM's: the 256 byte symbols,
# three special tokens, a few merges; the rest of the vocabulary is unused.
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MERGES = ["Ġ t", "h e", "Ġt he", "i n"]
_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% endif %}")


def _write_tokenizer(writer: GGUFWriter, vocab_size: int) -> None:
    tokens = list(bytes_to_unicode().values()) + _SPECIAL_TOKENS + [m.replace(" ", "")
                                                                      for m in _MERGES]
    types = ([TokenType.NORMAL] * 256 + [TokenType.CONTROL] * len(_SPECIAL_TOKENS)
             + [TokenType.NORMAL] * len(_MERGES))
    unused = vocab_size - len(tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens + [f"<unused_{i}>" for i in range(unused)])
    writer.add_token_types(types + [TokenType.UNUSED] * unused)
    writer.add_token_merges(_MERGES)
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(258)
    writer.add_chat_template(_CHAT_TEMPLATE)


def write_gguf(model: torch.nn.Module, path: str, with_tokenizer: bool = False) -> None:
    """with_tokenizer: also a small byte-level BPE tokenizer and chat template,
    so transformers can load a whole model (weights and tokenizer) from the file."""
    arch = _ARCHS[model.config.model_type]
    writer = GGUFWriter(path, MODEL_ARCH_NAMES[arch])
    _write_metadata(writer, model.config)
    if with_tokenizer:
        _write_tokenizer(writer, model.config.vocab_size)
    for name, data in _tensors(model, arch):
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
