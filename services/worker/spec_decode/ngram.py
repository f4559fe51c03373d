"""NgramProposer: prompt lookup. The sequence's last n tokens (n from
prompt_lookup_max down to prompt_lookup_min) are looked for earlier in its
prompt and output; the tokens that followed their earliest occurrence are the
drafts (vLLM's rule: the longest n-gram, then the earliest match)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int):
        self.k = num_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray, k: int | None = None) -> list[int]:
        """Up to k (default num_speculative_tokens) drafts to follow `tokens`."""
        k = self.k if k is None else k
        total = len(tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            # Windows that start before the suffix itself: an earlier occurrence.
            windows = sliding_window_view(tokens[:total - 1], n)
            hits = np.flatnonzero((windows == tokens[total - n:]).all(axis=1))
            if len(hits):
                start = int(hits[0]) + n
                return tokens[start:start + k].tolist()
        return []
