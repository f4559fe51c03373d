"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

One implementation; the architectures differ only in class-level switches:
bias on q/k/v (Qwen2) and RMSNorm on q and k per head (Qwen3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from services.worker.attention import AttentionMetadata, CpuPagedBackend
from services.worker.layers import RMSNorm, Rope, RotaryEmbedding, apply_rope
from services.worker.linear import (PackedColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                    VocabParallelEmbedding)
from services.worker.models.cpu_decode_layers import CpuDecodeLayers
from services.worker.parallel import SINGLE, TensorParallel
from services.worker.pipeline import SINGLE_STAGE, IntermediateTensors, PipelineStage


@dataclass(frozen=True)
class ArchFlags:
    """What sets one Llama-family architecture apart from another."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3)


def sliding_window(config) -> int | None:
    """The attention window of the config's sliding-window layers, if it has any."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    # Without layer_types (Mistral) a window applies to every layer; Qwen2/3 name
    # the layers that use it (none unless use_sliding_window).
    if window is None or (layer_types is not None and "sliding_attention" not in layer_types):
        return None
    return window


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def check_supported(config, max_positions: int) -> None:
    """Raises for what the model would otherwise compute wrongly without a word."""
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act {act!r} is not supported (only 'silu')")
    window = sliding_window(config)
    # A query attends to at most `window` keys, itself included: within
    # max_positions <= window that is plain causal attention.
    if window is not None and max_positions > window:
        raise NotImplementedError(f"sliding-window attention (window {window}) is not supported;"
                                  f" use max_model_len <= {window}")


class LlamaAttention(nn.Module):
    """Self-attention over this rank's share of the heads."""

    def __init__(self, config, max_positions: int, arch: ArchFlags, backend, tp: TensorParallel):
        super().__init__()
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.num_heads = tp.divide(num_heads, "num_attention_heads")
        self.num_kv_heads = tp.divide(num_kv_heads, "num_key_value_heads")
        self.scale = self.head_dim ** -0.5
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        self.qkv_proj = PackedColumnParallelLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=arch.qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, bias=arch.o_bias, tp=tp)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if arch.qk_norm else None
        self.backend = backend
        # This layer's KV cache, as the backend's bind_cache presents it; set by
        # the model runner.
        self.kv_cache = None

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """`rows`: the only rows to project out (None: all); every row's K and V
        still go into the cache."""
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        apply_rope(q, k, rope)
        out = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale)
        out = out.reshape(-1, self.num_heads * self.head_dim)
        return self.o_proj(out if rows is None else out[rows])


class LlamaMLP(nn.Module):
    def __init__(self, config, tp: TensorParallel):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        size = config.intermediate_size
        self.gate_up_proj = PackedColumnParallelLinear(
            config.hidden_size, {"gate": size, "up": size}, bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, max_positions: int, arch: ArchFlags, backend, tp: TensorParallel):
        super().__init__()
        self.self_attn = LlamaAttention(config, max_positions, arch, backend, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: Rope, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream
        (vLLM's form: each norm adds it in the same pass). `rows`: the only rows
        to carry on past attention (None: all)."""
        if residual is None:  # the first layer: x is the embedding
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, meta, rows)
        if rows is not None:
            residual = residual[rows]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class MissingLayer(nn.Module):
    """A place held for a layer another pipeline stage runs (vLLM's PPMissingLayer):
    the layer indices stay those of the checkpoint, and nothing is allocated."""


class LlamaModel(nn.Module):
    def __init__(self, config, max_positions: int, arch: ArchFlags, backend, tp: TensorParallel,
                 stage: PipelineStage = SINGLE_STAGE):
        super().__init__()
        self.stage = stage
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
                             if stage.is_first else None)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, max_positions, arch, backend, tp) if stage.owns(i)
            else MissingLayer() for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if stage.is_last else None
        self.rotary = RotaryEmbedding(config, head_dim_of(config), max_positions)
        # Decode steps through every layer in one C++ call, where the worker set it
        # up (cpu_decode_layers.py).
        self.cpu_decode: CpuDecodeLayers | None = None

    @property
    def own_layers(self) -> list[LlamaDecoderLayer]:
        return [layer for layer in self.layers if not isinstance(layer, MissingLayer)]

    def forward(self, input_ids, positions, meta,
                intermediate: IntermediateTensors | None = None,
                output_rows: torch.Tensor | None = None):
        """The final hidden states on the last stage, of `output_rows` only where
        given; on any other stage, what the next one takes (the first stage embeds
        input_ids, the others start from `intermediate`)."""
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = intermediate.hidden, intermediate.residual
        rope = self.rotary(positions)
        if self.cpu_decode is not None and self.cpu_decode.takes(x, meta):
            out = self.cpu_decode(x, rope, meta)
            return out if output_rows is None else out[output_rows]
        layers = self.own_layers
        # Past the last layer's attention no row reads another, so the rows nobody
        # reads (a prompt's but its last) stop there: a prefill skips most of that
        # layer's linears (llama.cpp's output ids).
        rows = output_rows if self.stage.is_last else None
        for i, layer in enumerate(layers):
            x, residual = layer(rope, x, residual, meta, rows if i == len(layers) - 1 else None)
        if not self.stage.is_last:
            return IntermediateTensors(x, residual)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # Checkpoint name -> (our packed parameter, shard) for projections we fuse.
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    @staticmethod
    def arch_flags(config) -> ArchFlags:
        bias = getattr(config, "attention_bias", False)
        return ArchFlags(qkv_bias=bias, o_bias=bias)

    def __init__(self, config, max_positions: int, backend=None, tp: TensorParallel = SINGLE,
                 stage: PipelineStage = SINGLE_STAGE):
        super().__init__()
        check_supported(config, max_positions)
        self.config = config
        self.stage = stage
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaModel(config, max_positions, self.arch_flags(config),
                                backend or CpuPagedBackend(), tp, stage)
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, tp)
                        if stage.is_last else None)
        if self.tie_word_embeddings and stage.is_first and stage.is_last:
            self.lm_head.weight = self.model.embed_tokens.weight

    def use_cpu_decode_layers(self) -> bool:
        """Runs decode steps through the layers in one C++ call from now on, where
        every layer is plain (cpu_decode_layers.py); call once the linears are
        prepared and LoRA set up. Whether it could."""
        self.model.cpu_decode = CpuDecodeLayers.of(self.model)
        return self.model.cpu_decode is not None

    @property
    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.model.own_layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: IntermediateTensors | None = None,
                output_rows: torch.Tensor | None = None):
        """Hidden states [T, hidden] of the scheduled tokens, or of `output_rows`
        of them where given (on a pipeline stage before the last: its
        IntermediateTensors of every token)."""
        return self.model(input_ids, positions, meta, intermediate, output_rows)

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into on this stage; None for one
        another stage holds (or a tied head the embedding stands for)."""
        stage = self.stage
        if name.startswith("model.layers."):
            return name if stage.owns(int(name.split(".")[2])) else None
        if name.startswith("model.embed_tokens."):
            if stage.is_first:
                return name
            # A tied head on a last stage without the embedding loads the embedding.
            return "lm_head.weight" if stage.is_last and self.tie_word_embeddings else None
        if name.startswith(("model.norm.", "lm_head.")):
            # Some tied checkpoints still store the head; the embedding is authoritative.
            tied_copy = name == "lm_head.weight" and self.tie_word_embeddings
            return name if stage.is_last and not tied_copy else None
        return name

    def wants(self, checkpoint_name: str) -> bool:
        """Whether this stage reads the checkpoint tensor at all."""
        return self.checkpoint_name(checkpoint_name) is not None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype: the sampler widens them to fp32 when a row
        needs more than an argmax."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = self.checkpoint_name(name)
            if name is None or "rotary_emb" in name:
                continue
            shard = None
            for ckpt_name, (packed_name, shard_name) in self.packed_modules_mapping.items():
                if f".{ckpt_name}." in name:
                    name, shard = name.replace(ckpt_name, packed_name), shard_name
                    break
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            with torch.no_grad():
                if shard is not None:
                    loader(param, tensor, shard)
                elif loader is not None:
                    loader(param, tensor)
                else:  # replicated on every rank (norms)
                    param.copy_(tensor)
            loaded.add(name)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"checkpoint lacks parameters: {sorted(missing)[:5]}")


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def arch_flags(config) -> ArchFlags:
        return ArchFlags(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def arch_flags(config) -> ArchFlags:
        bias = getattr(config, "attention_bias", False)
        return ArchFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)
