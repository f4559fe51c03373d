"""Basic offline generation, as in vLLM's examples/offline_inference/basic.py.

    .venv/bin/python examples/offline_generate.py
"""
import sys

from llmserve import LLM, SamplingParams

prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]


def main(extra_llm_args: dict) -> None:
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=0)
    llm = LLM(**extra_llm_args)
    for output in llm.generate(prompts, sampling_params):
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")


if __name__ == "__main__":
    # Tests pass a small KV cache; by default the model's own defaults apply.
    main({"kv_cache_gib": float(sys.argv[1])} if len(sys.argv) > 1 else {})
