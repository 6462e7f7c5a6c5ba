"""Anchor sampling and the DFlash training mask, checked against hand-written examples."""

import torch

from blockdraft.training.masks import block_attention_mask, block_positions, sample_anchors


def _rows(*rows: str) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in r.replace(" ", "")] for r in rows])


def test_mask_matches_hand_written_example():
    # T = 5 context rows, two blocks of B = 3 anchored at positions 1 and 3.
    # Keys: ctx 0..4 | block0 (pos 1,2,3) | block1 (pos 3,4,5)
    mask = block_attention_mask(torch.tensor([[1, 3]]), torch.tensor([[True, True]]), seq_len=5, block_size=3)
    expected = _rows(
        # ctx   | b0  | b1
        "10000 111 000",  # block 0 sees context < 1 and its own block
        "10000 111 000",
        "10000 111 000",
        "11100 000 111",  # block 1 sees context < 3 and its own block
        "11100 000 111",
        "11100 000 111",
    )
    assert torch.equal(mask[0], expected)


def test_mask_causal_sliding_and_invalid_blocks():
    anchors, valid = torch.tensor([[2, 0]]), torch.tensor([[True, False]])
    mask = block_attention_mask(anchors, valid, seq_len=4, block_size=2, causal=True, sliding_window=2)
    expected = _rows(
        # ctx  | b0 | b1      query positions: b0 = 2, 3
        "0100 10 00",  # pos 2: ctx 1 (window 2 keeps 1..2, < anchor 2), itself
        "0000 11 00",  # pos 3: ctx none (window keeps 2..3), block rows 2, 3
        "0000 00 10",  # invalid block: own block only (causal), never context
        "0000 00 11",  # pos 1 of the invalid block: causal, window keeps 0..1
    )
    assert torch.equal(mask[0], expected)
    assert torch.equal(block_positions(anchors, 2), torch.tensor([[2, 3, 0, 1]]))


def test_sample_anchors_only_response_positions_with_a_label():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    lengths = torch.tensor([6, 3])
    g = torch.Generator().manual_seed(0)
    anchors, valid = sample_anchors(loss_mask, lengths, num_anchors=10, generator=g)
    assert anchors.shape == (2, 3)  # row 0 has 3 valid anchors (2, 3, 4); 5 has no label inside length 6
    assert anchors[0].tolist() == [2, 3, 4] and valid[0].all()
    assert anchors[1, 0].item() == 1 and valid[1].tolist() == [True, False, False]


def test_sample_anchors_distinct_sorted_and_deterministic():
    loss_mask = torch.ones(3, 50, dtype=torch.bool)
    lengths = torch.tensor([50, 40, 30])
    a1, v1 = sample_anchors(loss_mask, lengths, 8, torch.Generator().manual_seed(3))
    a2, _ = sample_anchors(loss_mask, lengths, 8, torch.Generator().manual_seed(3))
    assert torch.equal(a1, a2) and v1.all()
    for row, n in zip(a1, lengths):
        assert row.tolist() == sorted(set(row.tolist())) and int(row.max()) < n - 1
