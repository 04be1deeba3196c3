"""N-gram lookup proposals and the tree shape that verifies them."""

import torch

from speculative.lookup import NgramIndex
from speculative.tree import DraftTree


def test_lookup_copies_what_followed_the_latest_earlier_occurrence_of_the_longest_suffix():
    index = NgramIndex([1, 2, 3, 7, 8, 9, 2, 3, 5, 6, 0, 1, 2, 3])
    # Suffix (1, 2, 3) occurred at the start, followed by 7 8 9; the later (2, 3) -> 5 6 is a shorter match.
    assert index.propose(2) == [7, 8]
    index.extend([4, 2, 3])
    # No earlier (4, 2, 3): the bigram (2, 3) last occurred with continuation 4 (at the end of the tokens above).
    assert index.propose(3) == [4, 2, 3]
    assert index.propose(0) == []


def test_lookup_proposes_nothing_without_an_earlier_match_and_stops_at_the_end():
    assert NgramIndex([5]).propose(4) == []
    assert NgramIndex([1, 2, 3, 4]).propose(4) == []
    assert NgramIndex([1, 2, 3, 1, 2]).propose(8) == [3, 1, 2]  # the continuation runs into the suffix itself
    index = NgramIndex()
    index.extend([9, 9])
    assert index.propose(4) == []  # a unigram repeat is not a match (bigrams and longer only)
    index.extend([9])
    assert index.propose(4) == [9]


def test_tree_slots_see_only_their_own_path_at_the_depth_they_stand():
    tree = DraftTree.build(3, alternates=1, lookup=2)
    assert tree.parents == (-1, 0, 1, 0, 0, 4)
    assert (tree.width, tree.lookup_start) == (6, 4)
    assert tree.depths(torch.device("cpu")).tolist() == [0, 1, 2, 1, 1, 2]
    assert tree.visibility(torch.device("cpu")).int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 1, 0],
        [1, 0, 0, 0, 1, 1],
    ]
    assert tree.paths == ((), (1,), (1, 2), (3,), (4,), (4, 5))  # the slots a slot's prediction follows
    # A chain alone is the plain causal block.
    chain = DraftTree.build(4)
    assert chain.visibility(torch.device("cpu")).equal(torch.ones(4, 4, dtype=torch.bool).tril())
