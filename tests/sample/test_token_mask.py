"""A request's allowed_token_ids / bad_words masks per logits row (row i after drafts[:i]), and the
sampler's use of them: the sampled copy is masked, the logits that logprobs read are not."""

from __future__ import annotations

import torch

from blockdraft.sample.bitmask import apply_token_bitmask_, bitmask_words, pack_bitmask
from blockdraft.sample.sampler import SamplingTensors
from blockdraft.sample.token_mask import RequestTokenMask
from blockdraft.sampling_params import SamplingParams

V = 70  # three int32 words, the last one partly used; bits 31 and 63 exercise int32's sign bit


def _allowed(rows: torch.Tensor) -> list[set[int]]:
    """The allowed token ids of each bitmask row."""
    x = torch.zeros(rows.shape[0], V)
    apply_token_bitmask_(x, rows)
    return [set(torch.nonzero(r == 0).flatten().tolist()) for r in x]


def test_pack_bitmask_sets_exactly_the_allowed_bits():
    for ids in ([0], [31], [63, 64], [0, 31, 32, 69], list(range(V))):
        allowed = torch.zeros(V, dtype=torch.bool)
        allowed[ids] = True
        row = pack_bitmask(allowed)
        assert row.dtype == torch.int32 and row.shape == (bitmask_words(V),)
        assert _allowed(row[None]) == [set(ids)]


def test_each_row_bans_after_the_output_and_the_drafts_before_it():
    """bad words [[63], [31, 5], [1, 2, 3]] over allowed ids 0..9 and 31, 63: output [.., 1], drafts
    [2, 31, 1, 2]. Row 1 follows "1 2" (3 banned), row 2 "2 31" (5 banned), row 4 "1 2" again."""
    mask = RequestTokenMask(V, list(range(10)) + [31, 63], [[63], [31, 5], [1, 2, 3]])
    assert mask.reads_output and mask.history == 2
    out = torch.zeros(5, bitmask_words(V), dtype=torch.int32)
    mask.fill(out, [7, 7, 1], [2, 31, 1, 2])
    base = set(range(10)) | {31}
    assert _allowed(out) == [base, base - {3}, base - {5}, base, base - {3}]
    # the same rows one at a time, as plain decoding reaches them: row i sees output + drafts[:i]
    drafts = [2, 31, 1, 2]
    for i in range(5):
        one = torch.zeros(1, bitmask_words(V), dtype=torch.int32)
        mask.fill(one, [7, 7, 1] + drafts[:i], [])
        assert _allowed(one) == [_allowed(out)[i]]


def test_only_the_output_counts_and_short_outputs_ban_nothing_long():
    mask = RequestTokenMask(V, None, [[1, 2, 3]])
    out = torch.zeros(2, bitmask_words(V), dtype=torch.int32)
    mask.fill(out, [], [1])  # row 0: no output yet; row 1: "1" alone is half the prefix
    assert _allowed(out) == [set(range(V))] * 2
    mask.fill(out, [1], [2])
    assert _allowed(out) == [set(range(V)), set(range(V)) - {3}]


def test_static_masks_do_not_read_the_output():
    mask = RequestTokenMask(V, [4, 5, 6], [[5], [9]])
    assert not mask.reads_output
    out = torch.zeros(3, bitmask_words(V), dtype=torch.int32)
    mask.fill(out, [5, 5], [1, 2])
    assert _allowed(out) == [{4, 6}] * 3


def test_sampling_mask_changes_the_sample_but_not_the_logits_logprobs_read():
    logits = torch.zeros(2, V)
    logits[:, 9] = 5.0  # the argmax, banned in row 1 only
    before = logits.clone()
    st = SamplingTensors.from_params([SamplingParams(), SamplingParams()])
    mask = RequestTokenMask(V, None, [[9]])
    rows = torch.zeros(1, bitmask_words(V), dtype=torch.int32)
    mask.fill(rows, [], [])
    st.sampling_mask, st.sampling_mask_rows = rows, torch.tensor([1])
    assert not st.argmax_only
    tokens = st.sample(logits, torch.tensor([1, 1]))
    assert tokens[0] == 9 and tokens[1] != 9
    assert torch.equal(logits, before)


def test_first_disallowed_finds_the_token_a_fully_masked_row_sampled():
    m = RequestTokenMask(16, [1, 2, 3, 9], [[9], [1, 2], [3, 1, 2]])
    assert m.first_disallowed([], [1, 3, 2, 2]) is None  # 2 after 1 is banned, after 3 it is not
    assert m.first_disallowed([], [3, 1, 2]) == 2  # the 2 after 1
    assert m.first_disallowed([7, 1], [2]) == 0  # the prefix may lie in the committed output
    assert m.first_disallowed([5, 3], [1, 3]) is None  # "3 1" then 3: no sequence ends with 3
    assert m.first_disallowed([], [4]) == 0 and m.first_disallowed([], [9]) == 0  # not allowed / one-token word
    assert RequestTokenMask(16, None).first_disallowed([], [15, 0]) is None


def test_first_disallowed_and_the_row_masks_apply_one_rule():
    """The commit-time check (first_disallowed) forbids exactly the tokens the row masks (fill) clear."""
    import random

    rng = random.Random(0)
    for _ in range(200):
        seqs = [[rng.randrange(6) for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 4))]
        allowed = sorted(rng.sample(range(V), 40)) + list(range(6)) if rng.random() < 0.5 else None
        m = RequestTokenMask(V, allowed, seqs)
        output, drafts = [rng.randrange(6) for _ in range(rng.randint(0, 4))], [rng.randrange(6) for _ in range(3)]
        rows = torch.empty(4, bitmask_words(V), dtype=torch.int32)
        m.fill(rows, output, drafts)
        for i, row_allowed in enumerate(_allowed(rows)):
            for t in range(V):
                assert (m.first_disallowed(output + drafts[:i], [t]) is None) == (t in row_allowed), (seqs, t)
