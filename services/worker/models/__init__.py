"""Model registry: HF `architectures` name -> our implementation."""
from services.worker.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

# Configs read from GGUF files name no architectures, only a model_type.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def model_class_for(config):
    architectures = getattr(config, "architectures", None) or []
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    model_type = getattr(config, "model_type", None)
    if not architectures and model_type in MODEL_TYPES:
        return MODEL_REGISTRY[MODEL_TYPES[model_type]]
    raise ValueError(f"unsupported architecture {architectures or model_type}; "
                     f"supported: {sorted(MODEL_REGISTRY)}")
