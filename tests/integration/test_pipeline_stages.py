"""Pipeline stages in one process: each stage's model loads only its layers (and the
embedding, or the final norm and the head), and the stages run one after another,
each handing the next its IntermediateTensors, give transformers' logits over the
mixed paged batch. The processes, the torch.distributed hand-off and the batch
queue are tested in tests/e2e/test_pipeline_parallel.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, Qwen3Config

from services.worker.model_loader import load_model
from services.worker.pipeline import SINGLE_STAGE, PipelineStage
from tests.integration.tiny_models import MAX_POSITIONS, TINY, max_logits_diff, tiny_hf_model

CPU = torch.device("cpu")


class Chained(nn.Module):
    """The stages of one pipeline as one model, for the single-process ModelRunner:
    each stage's output is the next one's input, as the workers pass it."""

    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.config = stages[0].config
        self.stage = SINGLE_STAGE

    @property
    def attention_layers(self):
        return [layer for s in self.stages for layer in s.attention_layers]

    def forward(self, input_ids, positions, meta):
        out = None
        for s in self.stages:
            out = s(input_ids, positions, meta, out)
        return out

    def compute_logits(self, hidden):
        return self.stages[-1].compute_logits(hidden)


def load_stages(path: str, num_stages: int, partition: str = "") -> list[nn.Module]:
    return [load_model(path, torch.float32, MAX_POSITIONS, CPU,
                       stage_for=lambda n, rank=rank: PipelineStage.of(rank, 1, num_stages, n,
                                                                       partition))
            for rank in range(num_stages)]


CASES = {
    "llama-tied-2-stages": (lambda: LlamaConfig(**{**TINY, "num_hidden_layers": 3},
                                                tie_word_embeddings=True), 2, ""),
    "llama-untied-3-stages": (lambda: LlamaConfig(**{**TINY, "num_hidden_layers": 4},
                                                  tie_word_embeddings=False), 3, ""),
    "qwen3-tied-partitioned": (lambda: Qwen3Config(**{**TINY, "num_hidden_layers": 4},
                                                   head_dim=32, tie_word_embeddings=True),
                               2, "3,1"),
}


@pytest.mark.parametrize("case", CASES)
def test_stages_chained_match_transformers(case, tmp_path):
    make_config, num_stages, partition = CASES[case]
    hf_model = tiny_hf_model(make_config())
    hf_model.save_pretrained(tmp_path)
    stages = load_stages(str(tmp_path), num_stages, partition)
    assert max_logits_diff(Chained(stages), hf_model) < 1e-4


def test_each_stage_holds_only_its_own_weights(tmp_path):
    """Counted from the loaded parameters: the layers of a stage and nothing of the
    others; the first has the embedding, the last the norm and the (tied) head, and
    together they hold exactly the whole model."""
    config = LlamaConfig(**{**TINY, "num_hidden_layers": 5}, tie_word_embeddings=True)
    tiny_hf_model(config).save_pretrained(tmp_path)
    whole = dict(load_model(str(tmp_path), torch.float32, MAX_POSITIONS, CPU).named_parameters())
    stages = load_stages(str(tmp_path), 3)
    names = [set(dict(s.named_parameters())) for s in stages]
    layers = [{int(n.split(".")[2]) for n in ns if n.startswith("model.layers.")} for ns in names]
    assert layers == [{0, 1}, {2, 3}, {4}]  # vLLM's rule: the remainder before the last
    assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" not in names[0]
    assert not any(n.startswith(("model.embed_tokens", "model.norm", "lm_head")) for n in names[1])
    assert {"model.norm.weight", "lm_head.weight"} <= names[2]
    assert "model.embed_tokens.weight" not in names[2]
    counts = [sum(p.numel() for p in s.parameters()) for s in stages]
    head = config.vocab_size * config.hidden_size  # the tied head: a second copy on stage 3
    assert sum(counts) == sum(p.numel() for p in whole.values()) + head
    torch.testing.assert_close(dict(stages[2].named_parameters())["lm_head.weight"],
                               whole["model.embed_tokens.weight"], rtol=0, atol=0)
    for stage in stages:  # every value is the whole model's own
        for name, param in stage.named_parameters():
            if name != "lm_head.weight":
                torch.testing.assert_close(param, whole[name], rtol=0, atol=0)
