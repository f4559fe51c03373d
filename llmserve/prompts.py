"""The prompt forms the offline API takes, as vLLM has them, read into the
frontend's input kinds (text, token ids, chat)."""
from __future__ import annotations

from typing import Any

from services.common.errors import InvalidArgument
from services.frontend.processor import ChatMessage

# A str, {"prompt": str}, {"prompt_token_ids": list[int]}; also (llmserve) a
# bare list of token ids or a chat (a list of {"role", "content"} messages).
PromptType = str | dict[str, Any] | list[int] | list[dict[str, str]]


def is_single_prompt(prompts: Any) -> bool:
    """True for one prompt, False for a list of prompts."""
    if isinstance(prompts, (str, dict)):
        return True
    return bool(prompts) and isinstance(prompts[0], int) or _is_chat(prompts)


def input_kwargs(prompt: PromptType) -> dict:
    """Keyword arguments for Processor.tokenize."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return {"token_ids": list(prompt["prompt_token_ids"])}
        if "prompt" in prompt:
            return {"prompt": prompt["prompt"]}
        raise InvalidArgument("prompt", f"a prompt dict needs 'prompt' or 'prompt_token_ids' "
                                        f"(got keys {sorted(prompt)})")
    if _is_chat(prompt):
        return {"chat": [ChatMessage(m["role"], m["content"]) for m in prompt]}
    if all(isinstance(t, int) for t in prompt):
        return {"token_ids": list(prompt)}
    raise InvalidArgument("prompt", f"not a prompt: {type(prompt).__name__}")


def prompt_text(prompt: PromptType) -> str | None:
    """The prompt's text, when it was given as text."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        return prompt.get("prompt")
    return None


def _is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) \
        and "role" in prompt[0]
