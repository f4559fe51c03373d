"""PEFT LoRA adapters built at test time, and their transformers + peft greedy
references."""
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from tests.conftest import hf_generate_greedy

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(model_dir: str, path, seed: int, **config) -> None:
    """A peft adapter with A and B both random: peft starts B at zero, which would
    make any comparison blind. Small values keep the text readable."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(init_lora_weights=False, **config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.05)
    model.save_pretrained(path)


def peft_greedy(model_dir: str, adapter_path: str | None, prompts: list[list[int]],
                max_new_tokens: int) -> list[list[int]]:
    """transformers (+ peft with the adapter, when given) greedy outputs."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, adapter_path)
    model.eval()
    return [hf_generate_greedy(model, ids, max_new_tokens) for ids in prompts]
