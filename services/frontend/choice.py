"""ChoiceState: the frontend's state of one choice (one engine request): its
incremental text, stop strings, logprobs and timings, reported as ChoiceOutputs
in the DELTA / CUMULATIVE / FINAL_ONLY output kinds."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from services.common.request_types import EngineCoreOutput, FinishReason, Logprobs
from services.common.sampling_params import OutputKind, SamplingParams
from services.frontend.detokenizer import IncrementalDetokenizer, add_token_texts


@dataclass
class ChoiceOutput:
    """One choice as reported now: a delta or everything so far (per output kind)."""

    index: int
    text: str
    token_ids: list[int]
    # None unless the request asked for logprobs.
    logprobs: list[Logprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended the choice; None for EOS.
    stop_reason: str | int | None = None
    # Totals so far, whatever the output kind.
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0
    # Seconds from arrival; set once the choice has finished.
    time_to_first_token_s: float | None = None
    total_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class ChoiceState:
    index: int
    engine_request_id: str
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    # True once a stop string ended the choice: the engine request must be aborted.
    stopped_by_string: bool = False
    # Beam search: the beam's cumulative logprob, reported with or without logprobs.
    beam_cumulative_logprob: float | None = None
    _sent_text: int = 0
    _sent_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, output: EngineCoreOutput) -> ChoiceOutput | None:
        """Applies one engine output; returns what to report now, if anything."""
        if self.finished:
            return None
        self.num_cached_tokens = output.num_cached_tokens
        tokens, logprobs = output.new_token_ids, output.new_logprobs
        if tokens:
            self.last_token_time = time.monotonic()
            if self.first_token_time is None:
                self.first_token_time = self.last_token_time
        # Accepted drafts come several to an output: a stop string may end the
        # choice at any of them, and the tokens after that one are not the choice's.
        step = 1 if self.params.stop else max(1, len(tokens))
        for i in range(0, max(1, len(tokens)), step):
            self._add_tokens(tokens[i:i + step], logprobs[i:i + step])
            if i + step >= len(tokens) and output.finish_reason is not None:
                self._finish(output.finish_reason, self._stop_token(output))
            self._check_stop_strings()
            if self.finished:
                break
        return self._report()

    def _add_tokens(self, token_ids: list[int], logprobs: list[Logprobs]) -> None:
        self.token_ids += token_ids
        if self.params.logprobs is not None:
            add_token_texts(self.detokenizer.tokenizer, logprobs)
            self.logprobs += logprobs
            self.cumulative_logprob += sum(lp.logprob for lp in logprobs)
        self.text += self.detokenizer.add_tokens(token_ids)

    def _stop_token(self, output: EngineCoreOutput) -> int | None:
        if output.finish_reason is FinishReason.STOP and output.new_token_ids:
            token = output.new_token_ids[-1]
            if token in self.params.stop_token_ids:
                return token
        return None

    def _check_stop_strings(self) -> None:
        if not self.params.stop:
            return
        # Only the new text (plus an overlap) can hold a stop string not seen before.
        start = max(0, self._sent_text - max(map(len, self.params.stop)))
        hits = [(self.text.find(s, start), s) for s in self.params.stop]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if not hits:
            return
        pos, stop = min(hits)
        self.text = self.text[:pos + len(stop) if self.params.include_stop_str_in_output else pos]
        self.stopped_by_string = not self.finished
        self.finish_reason = None
        self._finish(FinishReason.STOP, stop)

    def _finish(self, reason: FinishReason, stop_reason: str | int | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.monotonic()

    def _sendable(self) -> int:
        """How much text may be shown: text that could be the beginning of a stop
        string is held back until it is known not to be one."""
        holdback = 0 if self.finished or not self.params.stop else max(map(len, self.params.stop)) - 1
        return max(self._sent_text, len(self.text) - holdback)

    def _report(self) -> ChoiceOutput | None:
        kind = self.params.output_kind
        if kind is OutputKind.FINAL_ONLY and not self.finished:
            return None
        sendable = self._sendable()
        if kind is OutputKind.DELTA:
            text = self.text[self._sent_text:sendable]
            tokens = self.token_ids[self._sent_tokens:]
            logprobs = self.logprobs[self._sent_tokens:]
        else:
            text, tokens, logprobs = self.text[:sendable], list(self.token_ids), list(self.logprobs)
        if not text and not tokens and not self.finished:
            return None
        self._sent_text, self._sent_tokens = sendable, len(self.token_ids)
        return self._output(text, tokens, logprobs)

    def final_output(self) -> ChoiceOutput:
        """Everything, once finished (what FINAL_ONLY reports)."""
        return self._output(self.text, list(self.token_ids), list(self.logprobs))

    def _output(self, text: str, tokens: list[int], logprobs: list[Logprobs]) -> ChoiceOutput:
        wants_logprobs = self.params.logprobs is not None
        output = ChoiceOutput(
            index=self.index, text=text, token_ids=tokens,
            logprobs=logprobs if wants_logprobs else None,
            cumulative_logprob=(self.beam_cumulative_logprob
                                if self.beam_cumulative_logprob is not None
                                else self.cumulative_logprob if wants_logprobs else None),
            finish_reason=self.finish_reason, stop_reason=self.stop_reason,
            num_generated_tokens=len(self.token_ids), num_cached_tokens=self.num_cached_tokens)
        if self.finished:
            first = self.first_token_time or self.finish_time
            output.time_to_first_token_s = first - self.arrival_time
            output.total_s = self.finish_time - self.arrival_time
        return output
