"""SuffixProposer: suffix decoding (Oliaro et al., 2024; vLLM's method "suffix").

The drafts continue the longest suffix of the sequence that occurred before,
in its own prompt and output or in the outputs of earlier requests (agents and
repeated tasks produce the same text again). Every occurrence of that suffix
votes for its next token; the drafts follow the most frequent continuation,
token by token, while its share of the votes stays at min_token_prob or more,
and never run longer than the match they come from.

The index maps each pair of consecutive tokens in the cached outputs to where
it occurred (the latest MAX_OCCURRENCES), so a lookup reads a few candidates,
not the cache.
"""
from __future__ import annotations

import collections

import numpy as np

MAX_DEPTH = 24  # the longest suffix matched (vLLM's suffix_decoding_max_tree_depth)
MAX_OCCURRENCES = 64  # per token pair in the cache index


class SuffixProposer:
    def __init__(self, num_tokens: int, max_cached_requests: int, min_token_prob: float):
        self.k = num_tokens
        self.max_cached_requests = max_cached_requests
        self.min_token_prob = min_token_prob
        self._outputs: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self._next_id = 0
        # (token, next token) -> (output id, where the token after them is).
        self._index: dict[tuple[int, int], collections.deque] = {}

    def cache_output(self, output_token_ids: np.ndarray) -> None:
        """Keeps a finished request's output to draft from; the oldest goes first."""
        if self.max_cached_requests == 0 or len(output_token_ids) < 3:
            return
        output_id, self._next_id = self._next_id, self._next_id + 1
        self._outputs[output_id] = output = np.array(output_token_ids, dtype=np.int64)
        for i, pair in enumerate(zip(output[:-2].tolist(), output[1:-1].tolist())):
            self._index.setdefault(pair, collections.deque(maxlen=MAX_OCCURRENCES)).append(
                (output_id, i + 2))
        while len(self._outputs) > self.max_cached_requests:
            self._outputs.popitem(last=False)  # its index entries are skipped from now on

    def propose(self, tokens: np.ndarray, k: int | None = None) -> list[int]:
        """Up to k (default num_speculative_tokens) drafts to follow `tokens`."""
        k = self.k if k is None else k
        if len(tokens) < 3 or k <= 0:
            return []
        pattern = tokens[-MAX_DEPTH:][::-1]  # reversed: pattern[d] is d tokens back
        matches = [(_match_length(seq, end, pattern), seq, end)
                   for seq, end in self._candidates(tokens)]
        if not matches:
            return []
        longest = max(length for length, _, _ in matches)
        return self._vote([(seq, end) for length, seq, end in matches if length == longest],
                          min(k, longest))

    def _candidates(self, tokens: np.ndarray):
        """(sequence, end) where sequence[end - 2:end] are the last two tokens and
        sequence[end] exists: in the request itself, then in cached outputs."""
        a, b = tokens[-2], tokens[-1]
        own = np.flatnonzero((tokens[:-2] == a) & (tokens[1:-1] == b)) + 2
        for end in own.tolist():
            yield tokens, end
        for output_id, end in self._index.get((int(a), int(b)), ()):
            output = self._outputs.get(output_id)
            if output is not None:
                yield output, end

    def _vote(self, candidates: list[tuple[np.ndarray, int]], max_len: int) -> list[int]:
        """The most frequent continuation, token by token, while its share holds."""
        drafts: list[int] = []
        for step in range(max_len):
            following = [(int(seq[end + step]), seq, end) for seq, end in candidates
                         if end + step < len(seq)]
            if not following:
                break
            counts = collections.Counter(token for token, _, _ in following)
            token, count = counts.most_common(1)[0]
            if count < self.min_token_prob * len(following):
                break
            drafts.append(token)
            candidates = [(seq, end) for t, seq, end in following if t == token]
        return drafts


def _match_length(sequence: np.ndarray, end: int, pattern: np.ndarray) -> int:
    """How many tokens before `end` equal the pattern's (reversed) ones."""
    depth = min(end, len(pattern))
    before = sequence[end - depth:end][::-1]
    differ = np.flatnonzero(before != pattern[:depth])
    return int(differ[0]) if len(differ) else depth
