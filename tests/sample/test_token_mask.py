"""A request's allowed_token_ids / bad_words masks per logits row (row i after drafts[:i]), and the
sampler's use of them: the sampled copy is masked, the logits that logprobs read are not."""

from __future__ import annotations

import torch

from blockdraft.sample.bad_words import banned_tokens
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


# tokens of the randomised tests below: word boundaries, both int32 sign bits, and the last id of
# a vocabulary that is no multiple of 32 (the last word is partly used)
V_ODD = 101
POOL = [0, 1, 2, 30, 31, 32, 33, 63, 64, 95, 96, 100]


def _reference_fill(allowed, sequences, output, drafts) -> torch.Tensor:
    """fill's rows by definition: row i allows `allowed` ([V] bool) less banned_tokens(sequences,
    output + drafts[:i]), one token at a time, then packed; the whole output is passed."""
    rows = []
    for i in range(len(drafts) + 1):
        row = allowed.clone()
        for t in banned_tokens(sequences, output + drafts[:i]):
            row[t] = False
        rows.append(pack_bitmask(row))
    return torch.stack(rows)


def _random_sequences(rng) -> list[list[int]]:
    """1-4 token bad words over POOL; some extend or reuse another's prefix, some end alike."""
    seqs: list[list[int]] = []
    for _ in range(rng.randint(1, 12)):
        r = rng.random()
        if seqs and r < 0.3:  # a shared prefix, another last token
            other = rng.choice(seqs)
            seq = other[:rng.randint(0, len(other) - 1)]
            seq += [rng.choice(POOL) for _ in range(rng.randint(1, 4 - len(seq)))] if len(seq) < 4 else []
        elif seqs and r < 0.45:  # the same last token after another prefix
            seq = [rng.choice(POOL) for _ in range(rng.randint(0, 3))] + [rng.choice(seqs)[-1]]
        else:
            seq = [rng.choice(POOL) for _ in range(rng.randint(1, 4))]
        seqs.append(seq[:4] or [rng.choice(POOL)])
    return seqs


def _random_tokens(rng, seqs, n: int) -> list[int]:
    """n tokens from POOL with the bad words' prefixes spliced in (so rows match them)."""
    out: list[int] = []
    while len(out) < n:
        out += rng.choice(seqs)[:-1] if rng.random() < 0.4 else [rng.choice(POOL)]
    return out[:n]


def test_fill_equals_the_reference_rule_over_random_bad_words():
    """The indexed, vectorised fill writes exactly the reference rows (banned_tokens per row, one
    bit at a time) for random words, outputs and drafts (K 0..15), with and without allowed ids."""
    import random

    rng = random.Random(1)
    for _ in range(600):
        seqs = _random_sequences(rng)
        allowed_ids = rng.sample(range(V_ODD), rng.randint(1, V_ODD)) if rng.random() < 0.4 else None
        m = RequestTokenMask(V_ODD, allowed_ids, seqs)
        allowed = torch.zeros(V_ODD, dtype=torch.bool) if allowed_ids is not None else torch.ones(V_ODD, dtype=torch.bool)
        if allowed_ids is not None:
            allowed[allowed_ids] = True
        allowed[[s[0] for s in seqs if len(s) == 1]] = False
        output, drafts = _random_tokens(rng, seqs, rng.randint(0, 8)), _random_tokens(rng, seqs, rng.randint(0, 15))
        out = torch.full((len(drafts) + 1, bitmask_words(V_ODD)), 7, dtype=torch.int32)
        m.fill(out, output, drafts)
        assert torch.equal(out, _reference_fill(allowed, seqs, output, drafts)), (seqs, output, drafts)


def test_fill_bans_every_sequence_after_its_prefix():
    """Each multi-token word, its prefix ending the output, the drafts or both, bans its last token
    at the row after the prefix: fails when fill's index misses a sequence."""
    import random

    rng = random.Random(2)
    for _ in range(100):
        seqs = _random_sequences(rng)
        m = RequestTokenMask(V_ODD, None, seqs)
        for seq in (s for s in seqs if len(s) > 1):
            lead = [rng.choice(POOL) for _ in range(rng.randint(0, 3))]
            path = lead + seq[:-1]
            split = rng.randint(len(lead), len(path))  # where the output ends and the drafts start
            output, drafts = path[:split], path[split:] + [rng.choice(POOL) for _ in range(rng.randint(0, 2))]
            out = torch.empty(len(drafts) + 1, bitmask_words(V_ODD), dtype=torch.int32)
            m.fill(out, output, drafts)
            assert seq[-1] not in _allowed_odd(out[len(path) - split]), (seq, output, drafts)


def _allowed_odd(row: torch.Tensor) -> set[int]:
    """The allowed token ids of one V_ODD bitmask row."""
    x = torch.zeros(1, V_ODD)
    apply_token_bitmask_(x, row[None])
    return set(torch.nonzero(x[0] == 0).flatten().tolist())


def test_disallow_tokens_clears_each_bit_once_for_few_and_many_tokens():
    """Element writes (<= 8 tokens) and ufunc.at (more) agree with clearing one bit at a time,
    with repeats and several tokens in one int32 word (bit 31 included)."""
    import random

    from blockdraft.sample.bitmask import disallow_tokens_

    rng = random.Random(3)
    for n in (1, 3, 8, 9, 40, 200):
        rows = [rng.randrange(4) for _ in range(n)]
        tokens = [rng.choice(POOL + [rng.randrange(V_ODD)]) for _ in range(n)]
        mask = torch.full((4, bitmask_words(V_ODD)), -1, dtype=torch.int32)
        disallow_tokens_(mask, rows, tokens)
        want = torch.ones(4, bitmask_words(V_ODD) * 32, dtype=torch.bool)  # the bits past V stay set too
        for r, t in zip(rows, tokens):
            want[r, t] = False
        assert torch.equal(mask, torch.stack([pack_bitmask(w) for w in want])), (rows, tokens)
