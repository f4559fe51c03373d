"""Structured outputs in the engine core, on xgrammar (as in vLLM): how a
request's constraint is compiled into a grammar (in a child process of
grammar_compiler.py), and each request's matcher, which follows its output
token by token and says which tokens may come next.

xgrammar is imported on first use, so unconstrained serving never pays for it."""
from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING

import numpy as np

from services.common.errors import InvalidArgument
from services.common.structured_outputs import (FIELD, MAX_JSON_WHITESPACE,
                                                StructuredOutputsParams)

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)
# xgrammar's messages start with "[time] /path/file.cc:123: " and may hold a
# failed check's condition; the rest is what a person can act on.
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _error_text(error: Exception) -> str:
    """What a person can act on in an xgrammar error: its message without the
    source location. Some internal checks fail with no message at all."""
    text = _SOURCE_PREFIX.sub("", str(error)).strip()
    return text or (
        "xgrammar failed an internal check compiling it and gave no reason (seen with a "
        "JSON-schema pattern repeating a class thousands of times, such as [a-z]{1,5000}); "
        "simplify the constraint")


def compile_constraint(compiler: xgrammar.GrammarCompiler,
                       params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
    """Compiles a validated constraint with xgrammar; InvalidArgument naming it when
    it does not compile. Runs in a grammar compiler's child process
    (grammar_compiler.py), where a slow compile can be stopped."""
    kind = params.kind
    try:
        if kind in ("json", "json_object"):  # json_object: OpenAI's, always an object
            whitespace = ({"any_whitespace": False} if params.disable_any_whitespace else
                          {"any_whitespace": True, "max_whitespace_cnt": MAX_JSON_WHITESPACE})
            return compiler.compile_json_schema(params.json_text or '{"type": "object"}',
                                                **whitespace)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(params.choice))
        return compiler.compile_grammar(params.grammar)
    except (RuntimeError, ValueError) as e:  # how xgrammar reports parse errors
        raise InvalidArgument(f"{FIELD}.{kind}", _error_text(e)) from None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly the given strings (JSON string
    literals are also EBNF ones: the same quotes and escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class RequestGrammar:
    """One request's place in its grammar: which tokens may come next, advanced
    with each token the request accepts."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, stop_token_ids: list[int],
                 output_token_ids: list[int]):
        import xgrammar
        # The request's own EOS ids end the grammar (the tokenizer's may differ).
        self._matcher = xgrammar.GrammarMatcher(compiled,
                                                override_stop_tokens=stop_token_ids or None)
        self._bitmask = xgrammar.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
        self.violated = False
        # Tokens generated before the request moved here (from an engine core
        # that died): the grammar goes on after them.
        for token_id in output_token_ids:
            if not self.accept(token_id):
                raise InvalidArgument("output_token_ids", "do not follow the request's "
                                      "structured_outputs constraint")

    def accept(self, token_id: int) -> bool:
        """False (and the request should stop) if the grammar forbids the token,
        which the bitmask prevents unless other sampling options (min_tokens,
        allowed_token_ids, bad words) left no token it allows."""
        if not self._matcher.accept_token(token_id):
            logger.warning("token %d broke a request's structured-outputs constraint (its "
                           "other sampling options left no token the grammar allows): the "
                           "request stops", token_id)
            self.violated = True
        return not self.violated

    @property
    def is_done(self) -> bool:
        """The output is complete (a stop token was accepted), or went astray."""
        return self.violated or self._matcher.is_terminated()

    def allowed_drafts(self, drafts: list[int]) -> list[int]:
        """Speculative decoding: the longest prefix of the drafts the grammar allows
        after the tokens so far (the matcher is left where it was)."""
        return drafts[:self._walk(drafts, None)]

    def draft_bitmasks(self, drafts: list[int]) -> np.ndarray:
        """int32 [len(drafts) + 1, words]: the bitmask before the first draft, then
        after each (the rows the verification masks); the drafts must be allowed."""
        masks = [self.next_token_bitmask()]
        self._walk(drafts, masks)
        return np.stack(masks)

    def _walk(self, drafts: list[int], masks: list | None) -> int:
        """Accepts drafts while the grammar allows them (appending each next bitmask
        to masks), then rolls back; returns how many it allowed."""
        allowed = 0
        for token_id in drafts:
            if self._matcher.is_terminated() or not self._matcher.accept_token(token_id):
                break
            allowed += 1
            if masks is not None:
                masks.append(self.next_token_bitmask())
        if allowed:
            self._matcher.rollback(allowed)
        return allowed

    def next_token_bitmask(self) -> np.ndarray:
        """int32 [ceil(vocab / 32)]: bit t set where token t may come next."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask[0].numpy().copy()
