"""The baseline: transformers' `generate` on the same prompts and dtype, batched
with left padding and at batch 1, greedy, every request run to its full length."""
from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer

from bench.metrics import RequestTiming, single_stream_summary, summarize


class _TimingStreamer(BaseStreamer):
    """Records when generate() produces each token (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.timing = RequestTiming()
        self._saw_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if self._saw_prompt:
            self.timing.add(value.numel())
        self._saw_prompt = True

    def end(self) -> None:
        self.timing.finish()


class HFBaseline:
    def __init__(self, model_dir: str, dtype: str):
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype)).eval()
        self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.model.config.eos_token_id

    def _config(self, output_len: int) -> GenerationConfig:
        # min_new_tokens masks EOS, so every row generates output_len tokens (ignore_eos).
        return GenerationConfig(do_sample=False, max_new_tokens=output_len,
                                min_new_tokens=output_len, pad_token_id=self.pad_id,
                                eos_token_id=self.model.config.eos_token_id)

    def _generate(self, prompts: list[list[int]], output_len: int,
                  streamer: BaseStreamer | None = None) -> torch.Tensor:
        """Left-padded batch in, generated ids (batch, output_len) out."""
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask,
                                      generation_config=self._config(output_len),
                                      streamer=streamer)
        generated = out[:, width:]
        assert generated.shape == (len(prompts), output_len), generated.shape
        return generated

    def batched(self, prompts: list[list[int]], output_len: int) -> dict:
        """All prompts in one generate() call."""
        start = time.perf_counter()
        self._generate(prompts, output_len)
        seconds = time.perf_counter() - start
        output_tokens = len(prompts) * output_len
        prompt_tokens = sum(map(len, prompts))
        return {"batch_size": len(prompts), "requests": len(prompts), "seconds": seconds,
                "output_tokens": output_tokens, "output_tok_s": output_tokens / seconds,
                "total_tok_s": (output_tokens + prompt_tokens) / seconds}

    def stream(self, prompt: list[int], output_len: int) -> RequestTiming:
        """One prompt at batch 1, timing every token."""
        streamer = _TimingStreamer()
        self._generate([prompt], output_len, streamer)
        return streamer.timing

    def batch1(self, prompts: list[list[int]], output_len: int) -> dict:
        """The prompts one after another at batch 1: the latency baseline."""
        start = time.perf_counter()
        timings = [self.stream(p, output_len) for p in prompts]
        return {"batch_size": 1, **summarize(timings, time.perf_counter() - start)}

    def single_stream(self, prompt: list[int], output_len: int) -> dict:
        return single_stream_summary(self.stream(prompt, output_len))
