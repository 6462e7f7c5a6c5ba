"""apply_token_bitmask_: bit t % 32 of word t // 32 allows token t; everything else becomes -inf."""

import pytest
import torch

from blockdraft.sample.bitmask import apply_token_bitmask_, apply_token_bitmask_rows_, bitmask_words


def _dense_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    rows = []
    for words in bitmask.tolist():
        rows.append([bool((words[t // 32] >> (t % 32)) & 1) for t in range(vocab)])
    return torch.tensor(rows)


@pytest.mark.parametrize("vocab", [32, 45, 96, 131])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_logits_equal_a_token_by_token_reference(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, bitmask_words(vocab)), generator=g, dtype=torch.int64).to(torch.int32)
    bitmask[2] = -1  # an unconstrained row
    want = torch.where(_dense_allowed(bitmask, vocab), logits, torch.tensor(float("-inf"), dtype=dtype))
    out = apply_token_bitmask_(logits, bitmask)
    assert out is logits and torch.equal(logits, want)
    assert not torch.isinf(logits[2]).any()


def test_a_mask_of_one_token_leaves_only_it():
    logits = torch.zeros(1, 70)
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 2] = 1 << 3  # token 67
    apply_token_bitmask_(logits, bitmask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [67]


@pytest.mark.parametrize("shape, dtype", [((2, 3), torch.int32), ((1, 4), torch.int32), ((1, 3), torch.int64)])
def test_a_bitmask_that_does_not_fit_is_refused(shape, dtype):
    with pytest.raises(ValueError, match=r"token bitmask must be int32 \[1, 3\] for logits \[1, 70\]"):
        apply_token_bitmask_(torch.zeros(1, 70), torch.zeros(shape, dtype=dtype))


def test_masks_of_some_rows_leave_the_others_untouched():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 70, generator=g)
    want = logits.clone()
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), generator=g, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([4, 1])
    apply_token_bitmask_(want[4:5], bitmask[:1])
    apply_token_bitmask_(want[1:2], bitmask[1:])
    assert apply_token_bitmask_rows_(logits, bitmask, rows) is logits and torch.equal(logits, want)
    assert not torch.isinf(logits[[0, 2, 3, 5]]).any()
