"""LoRA adapters with the default model in process, against transformers + peft
with the same adapters (built here with peft, random non-zero B): greedy fp32
output is token-identical, alone and with several adapters and the base model
mixed in one batch; the prefix cache never shares blocks across adapters."""
import pytest

from llmserve import LLM, LoRARequest, SamplingParams
from services.common.errors import InvalidArgument
from tests.conftest import PROMPTS
from tests.lora_adapters import ALL_PROJECTIONS, build_adapter, peft_greedy

MAX_TOKENS = 16
ADAPTERS = {  # name -> (id, peft LoraConfig keywords)
    "all-r8": (1, dict(r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS)),
    "qv-r4-rslora": (2, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             use_rslora=True)),
    "mlp-r16": (3, dict(r=16, lora_alpha=16, target_modules=["gate_proj", "up_proj",
                                                               "down_proj"])),
}


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name, (lora_id, config) in ADAPTERS.items():
        build_adapter(model_dir, root / name, lora_id, **config)
        out[name] = LoRARequest(name, lora_id, str(root / name))
    return out


@pytest.fixture(scope="module")
def references(model_dir, tokenizer, adapters) -> dict:
    """(adapter name or None, prompt index) -> transformers + peft greedy tokens."""
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    refs = {}
    for name in [None, *adapters]:
        path = adapters[name].lora_path if name else None
        for i, tokens in enumerate(peft_greedy(model_dir, path, prompts, MAX_TOKENS)):
            refs[(name, i)] = tokens
    return refs


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, dtype="float32", max_model_len=512, enable_lora=True, max_loras=2,
               max_lora_rank=16)


def _greedy(llm, prompts, loras) -> list[list[int]]:
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                           use_tqdm=False, lora_request=loras)
    assert llm.llm_engine.engine_core.stats().num_used_kv_blocks == 0
    return [o.outputs[0].token_ids for o in outputs]


def test_each_adapter_alone_equals_peft(llm, adapters, references):
    for name, lora in adapters.items():
        got = _greedy(llm, PROMPTS[:3], lora)
        assert got == [references[(name, i)] for i in range(3)], name
        assert got != [references[(None, i)] for i in range(3)]  # the adapter changes the text


def test_adapters_and_the_base_model_mixed_in_one_batch(llm, adapters, references):
    """Three adapters and none across 12 requests with max_loras 2: at most two
    adapters run at once, every output equals its own reference."""
    names = [None, "all-r8", "qv-r4-rslora", "mlp-r16"]
    cases = [(names[(i + j) % 4], i) for i in range(3) for j in range(4)]
    got = _greedy(llm, [PROMPTS[i] for _, i in cases],
                  [adapters[n] if n else None for n, _ in cases])
    assert got == [references[case] for case in cases]


def test_the_prefix_cache_keeps_adapters_apart(llm, adapters, references):
    prompt = PROMPTS[0] * 4  # several full blocks
    params = SamplingParams(max_tokens=4, temperature=0)
    first = llm.generate(prompt, params, use_tqdm=False, lora_request=adapters["all-r8"])[0]
    other = llm.generate(prompt, params, use_tqdm=False, lora_request=adapters["mlp-r16"])[0]
    same = llm.generate(prompt, params, use_tqdm=False, lora_request=adapters["all-r8"])[0]
    base = llm.generate(prompt, params, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert same.num_cached_tokens >= 16 and same.outputs[0].token_ids == first.outputs[0].token_ids


def test_bad_adapters_are_invalid_argument(llm, model_dir, adapters, tmp_path):
    build_adapter(model_dir, tmp_path / "r32", 9, r=32, lora_alpha=32, target_modules=["q_proj"])
    cases = {LoRARequest("big", 9, str(tmp_path / "r32")): "max-lora-rank",
             LoRARequest("missing", 10, str(tmp_path / "nowhere")): "not a PEFT adapter",
             LoRARequest("all-r8", 11, adapters["mlp-r16"].lora_path): "loaded already",
             LoRARequest("zero", 0, adapters["all-r8"].lora_path): "lora_int_id"}
    for lora, message in cases.items():
        with pytest.raises(Exception, match=message):
            llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False, lora_request=lora)
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_lora_off_refuses_adapters(model_dir, adapters):
    plain = LLM(model_dir, dtype="float32", max_model_len=256)
    with pytest.raises(InvalidArgument, match="enable-lora"):
        plain.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False,
                       lora_request=adapters["all-r8"])
