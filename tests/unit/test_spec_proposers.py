"""The n-gram and suffix proposers on hand-made sequences."""
import numpy as np

from services.worker.spec_decode.ngram import NgramProposer
from services.worker.spec_decode.suffix import SuffixProposer


def a(*tokens):
    return np.array(tokens, dtype=np.int64)


def test_ngram_takes_the_longest_suffix_then_its_earliest_occurrence():
    p = NgramProposer(num_tokens=3, min_n=1, max_n=3)
    # [7, 8, 9] occurs at 0 (followed by 1, 2, 3) and the shorter [8, 9] at 5 too.
    assert p.propose(a(7, 8, 9, 1, 2, 8, 9, 5, 7, 8, 9)) == [1, 2, 8]
    assert p.propose(a(4, 5, 6, 4, 5, 6, 4, 5)) == [6, 4, 5]  # earliest match, overlapping
    assert p.propose(a(1, 2, 3)) == []  # nothing repeats
    assert p.propose(a(1, 2, 1, 2), k=1) == [1]


def test_ngram_respects_the_shortest_match():
    p = NgramProposer(num_tokens=2, min_n=2, max_n=3)
    assert p.propose(a(5, 1, 9, 9, 9, 1)) == []  # only a 1-token match
    assert p.propose(a(5, 1, 9, 3, 5, 1)) == [9, 3]


def test_suffix_follows_the_most_frequent_continuation_of_the_longest_match():
    p = SuffixProposer(num_tokens=4, max_cached_requests=10, min_token_prob=0.3)
    for out in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [9, 2, 3, 4, 8, 8]):
        p.cache_output(a(*out))
    # The suffix [1, 2, 3] matches twice (-> 4, 5, then 6 or 7, half the votes
    # each); [2, 3] three times, but it is shorter. Three drafts: the match's length.
    drafts = p.propose(a(0, 1, 2, 3))
    assert drafts[:2] == [4, 5] and drafts[2] in (6, 7) and len(drafts) == 3
    # After [3, 4, 5] the next token splits 6 / 7: each has half the votes (>= 0.3).
    assert p.propose(a(3, 4, 5), k=2) in ([6], [7])


def test_suffix_drafts_no_longer_than_the_match_and_stop_at_rare_tokens():
    p = SuffixProposer(num_tokens=8, max_cached_requests=10, min_token_prob=0.6)
    p.cache_output(a(1, 2, 3, 4, 5, 6, 7, 8, 9))
    assert p.propose(a(0, 2, 3)) == [4, 5]  # a 2-token match drafts 2
    q = SuffixProposer(num_tokens=8, max_cached_requests=10, min_token_prob=0.6)
    for tail in (5, 6, 7):
        q.cache_output(a(1, 2, 3, 4, tail, 0))
    assert q.propose(a(1, 2, 3, 4)) == []  # 5, 6, 7: a third each


def test_suffix_drafts_from_the_request_itself_and_forgets_old_outputs():
    p = SuffixProposer(num_tokens=3, max_cached_requests=1, min_token_prob=0.1)
    assert p.propose(a(5, 6, 7, 8, 5, 6)) == [7, 8]  # its own earlier text
    p.cache_output(a(1, 2, 3, 4))
    p.cache_output(a(9, 9, 9, 9))  # evicts the first
    assert p.propose(a(1, 2)) == []
