"""The draft vocabulary (blockdraft.spec.draft_vocab): ranking, the file, the sliced head, and the
speculator / engine with a slice (drafts restricted to it, output still the target's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from blockdraft.models import build_model
from blockdraft.spec.dflash import DFlashSpeculator, random_drafter
from blockdraft.spec.dflash.checkpoint import resolve_draft_vocab_size
from blockdraft.spec.draft_vocab import (
    DRAFT_VOCAB_FILE,
    DraftHead,
    check_draft_vocab_size,
    draft_vocab_capacity,
    leading_ids,
    load_draft_vocab,
    rank_dataset,
    rank_tokens,
    read_draft_vocab_metadata,
    save_draft_vocab,
    write_dataset_draft_vocab,
)
from tests.conftest import tiny_config
from tests.spec._dflash_util import TinyTarget, shuffled_block_table, slots_for, tiny_target_config


def _seq(ids, mask):
    return torch.tensor(ids), torch.tensor(mask, dtype=torch.bool)


def test_rank_counts_response_tokens_only_breaks_ties_by_id_and_puts_given_ids_first():
    sequences = [
        _seq([9, 9, 9, 4, 4, 7], [0, 0, 1, 1, 1, 1]),  # the two masked-out 9s must not count
        _seq([7, 2, 5, 5, 3, 8], [1, 1, 1, 1, 0, 1]),  # 3 is prompt-only
    ]
    # counts: 5:2, 4:2, 7:2, 9:1, 2:1, 8:1, rest 0. Ties by id: 4, 5, 7 | 2, 8, 9 | 0, 1, 3, 6.
    ids, counts, total = rank_tokens(sequences, vocab_size=10, always_include=(6, 0, 6))
    assert ids.tolist() == [6, 0, 4, 5, 7, 2, 8, 9, 1, 3]
    assert counts.tolist() == [0, 0, 2, 2, 2, 1, 1, 1, 0, 0]
    assert total == 9 and ids.dtype == counts.dtype == torch.int64
    top, top_counts, _ = rank_tokens(sequences, 10, always_include=(6,), max_size=3)
    assert top.tolist() == [6, 4, 5] and top_counts.tolist() == [0, 2, 2]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(always_include=(10,)), r"always-included ids \[10\] are outside the vocabulary \[0, 10\)"),
        (dict(always_include=(1, 2), max_size=1), "max_size must be >= max"),
        (dict(max_size=0), "max_size must be >= max"),
    ],
)
def test_rank_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        rank_tokens([_seq([1], [1])], 10, **kwargs)


def test_rank_refuses_out_of_vocab_and_mismatched_sequences():
    with pytest.raises(ValueError, match=r"sequence 0 holds token ids outside the vocabulary \[0, 10\)"):
        rank_tokens([_seq([1, 12], [1, 1])], 10)
    with pytest.raises(ValueError, match="sequence 1: token ids"):
        rank_tokens([_seq([1], [1]), (torch.tensor([1, 2]), torch.tensor([True]))], 10)


def test_leading_ids_are_the_sorted_eos_ids_then_the_pad_id_once():
    assert leading_ids([151645], 151643) == (151645, 151643)  # an EOS, then a pad id the target does not stop on
    assert leading_ids([151643, 151645], 151643) == (151643, 151645)  # Qwen2.5's: both stop ids, the pad among them
    assert leading_ids((7, 3, 7), 5) == (3, 7, 5)  # EOS sorted and deduplicated, the pad after them
    assert leading_ids([2], 2) == (2,)  # a pad that is an EOS id (SmolLM2) is not repeated
    assert leading_ids([4, 1], None) == (1, 4)  # no pad token: nothing added
    assert leading_ids([], 3) == (3,)


def test_the_written_draft_vocab_keeps_a_pad_id_the_answers_never_hold_right_after_the_eos_ids(tmp_path):
    from blockdraft.training.dataset import TokenDataset

    eos, pad, vocab = 6, 9, 10
    # pad (9) occurs only in a prompt (not counted); the EOS (6) ends each answer
    data = TokenDataset.from_pairs([([9, 1], [4, 4, 5, 6]), ([9, 2], [5, 3, 4, 6])], [False, False])
    lead = leading_ids([eos], pad)
    write_dataset_draft_vocab(tmp_path, data, vocab, lead, "test")
    written = load_draft_vocab(tmp_path, vocab, vocab_size=vocab)
    assert written[:2].tolist() == [eos, pad]
    assert written.tolist() == [6, 9, 4, 5, 3, 0, 1, 2, 7, 8]  # then by count, ties by id
    assert read_draft_vocab_metadata(tmp_path)["always_included"] == [eos, pad]
    # the slice trained on (--train-vocab-size 4) is the file's first 4 ids, pad included
    assert rank_dataset(data, vocab, lead, 4)[0].tolist() == written[:4].tolist()
    assert pad not in rank_dataset(data, vocab, (eos,), 4)[0].tolist()  # EOS alone would drop it


def _write(folder: Path, n: int = 6) -> torch.Tensor:
    ids = torch.tensor([5, 0, 3, 9, 1, 2][:n])
    save_draft_vocab(folder, ids, torch.arange(n, 0, -1), {"source": "test", "num_tokens": 21})
    return ids


def test_save_load_round_trip(tmp_path):
    ids = _write(tmp_path)
    assert (tmp_path / DRAFT_VOCAB_FILE).is_file() and draft_vocab_capacity(tmp_path) == 6
    assert load_draft_vocab(tmp_path, 4).tolist() == ids[:4].tolist()
    assert load_draft_vocab(tmp_path, 6, vocab_size=10).tolist() == ids.tolist()
    assert read_draft_vocab_metadata(tmp_path) == {"source": "test", "num_tokens": 21}
    assert draft_vocab_capacity(tmp_path / "nothing-here") is None


def test_size_checks_name_the_file_the_folder_and_the_range(tmp_path):
    _write(tmp_path)
    assert check_draft_vocab_size(0, tmp_path / "no-file") == 0  # full vocabulary: no file needed
    with pytest.raises(ValueError, match=rf"in \[1, 6\] for {tmp_path / DRAFT_VOCAB_FILE}.*got 7"):
        check_draft_vocab_size(7, tmp_path)
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match=r"integer >= 0 \(0: full vocabulary\), got"):
            check_draft_vocab_size(bad, tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"drafter folder {empty} has no {DRAFT_VOCAB_FILE}"):
        check_draft_vocab_size(3, empty)
    with pytest.raises(ValueError, match="load_draft_vocab needs size >= 1"):
        load_draft_vocab(tmp_path, 0)
    with pytest.raises(ValueError, match=r"holds token id 9 among its first 4, outside the target's vocabulary \[0, 8\)"):
        load_draft_vocab(tmp_path, 4, vocab_size=8)


def test_a_missing_draft_vocab_says_how_to_get_one_and_the_sizes_allowed(tmp_path):
    # A user's next step (which command writes the file), not an internal module; and the rule.
    with pytest.raises(FileNotFoundError) as info:
        check_draft_vocab_size(512, tmp_path, vocab_size=151936)
    message = str(info.value)
    assert f"draft_vocab_size 512 needs the drafter's ranked vocabulary, but drafter folder {tmp_path} has no " \
           f"{DRAFT_VOCAB_FILE}; use 0 (the full vocabulary, no file needed)" in message
    assert "`blockdraft train-drafter` writes it into OUT/drafter" in message
    assert "scripts/rank_draft_vocab.py" in message and "blockdraft.spec.draft_vocab" not in message
    assert message.endswith("draft_vocab_size must be 0 or at least 256 and at most the ids it ranks")
    with pytest.raises(FileNotFoundError, match=r"at least 6 and at most"):  # a tiny vocabulary: 1/16 of it
        check_draft_vocab_size(5, tmp_path, vocab_size=96)
    with pytest.raises(FileNotFoundError, match=r"at least 256 \(for a vocabulary under 4096 ids: 1/16 of it\)"):
        check_draft_vocab_size(5, tmp_path)


def test_sizes_below_the_useful_minimum_are_refused_when_the_vocabulary_is_known(tmp_path):
    """256 ids for real vocabularies (1/16 of a tiny one): smaller slices only lose drafts."""
    from blockdraft.spec.draft_vocab import min_draft_vocab_size

    save_draft_vocab(tmp_path, torch.arange(1000), torch.zeros(1000, dtype=torch.long), {"source": "test"})
    assert [min_draft_vocab_size(v) for v in (151936, 49152, 4096, 96, 10)] == [256, 256, 256, 6, 1]
    with pytest.raises(ValueError, match=r"must be 0 \(full vocabulary\) or in \[256, 1000\] for a target vocabulary "
                                         r"of 151936 ids .*got 10: a draft vocabulary under 256 ids saves almost no time"):
        check_draft_vocab_size(10, tmp_path, vocab_size=151936)
    with pytest.raises(ValueError, match=r"in \[256, 1000\].*got 255"):
        load_draft_vocab(tmp_path, 255, vocab_size=151936)
    assert check_draft_vocab_size(256, tmp_path, vocab_size=151936) == 256
    assert check_draft_vocab_size(0, tmp_path, vocab_size=151936) == 0
    assert load_draft_vocab(tmp_path, 6, vocab_size=96).tolist() == list(range(6))
    with pytest.raises(ValueError, match=r"in \[6, 1000\] for a target vocabulary of 96 ids.*got 5"):
        check_draft_vocab_size(5, tmp_path, vocab_size=96)
    assert check_draft_vocab_size(5, tmp_path) == 5  # V unknown (before the target's config is read): no minimum


def test_too_large_sizes_name_the_minimum_when_the_vocabulary_is_known(tmp_path):
    """Above the file's ids, the range named starts at the minimum (256), not 1: every value in
    the range the message names is accepted."""
    save_draft_vocab(tmp_path, torch.arange(1000), torch.zeros(1000, dtype=torch.long), {"source": "test"})
    with pytest.raises(ValueError, match=r"must be 0 \(full vocabulary\) or in \[256, 1000\] for a target vocabulary "
                                         r"of 151936 ids and .*draft_vocab.json \(1000 ranked ids\), got 1001$"):
        check_draft_vocab_size(1001, tmp_path, vocab_size=151936)
    with pytest.raises(ValueError, match=r"in \[1, 1000\] for .*got 1001"):  # V unknown: no minimum yet
        check_draft_vocab_size(1001, tmp_path)
    small = tmp_path / "small"
    save_draft_vocab(small, torch.arange(100), torch.zeros(100, dtype=torch.long), {"source": "test"})
    for size in (50, 100, 300):  # no size fits: the file ranks fewer ids than the minimum
        with pytest.raises(ValueError, match=r"ranks only 100 ids, fewer than the 256 a target vocabulary of 151936 "
                                             r"ids needs at least; use 0 \(full vocabulary\) or rank at least 256"):
            check_draft_vocab_size(size, small, vocab_size=151936)


def test_corrupt_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="repeated ids"):
        save_draft_vocab(tmp_path, torch.tensor([1, 1]), torch.tensor([2, 2]), {})
    file = tmp_path / DRAFT_VOCAB_FILE

    def write(**data):
        file.write_text(json.dumps({"format": "blockdraft-draft-vocab/1", **data}))

    write(token_ids=[1, 2, 2], counts=[0, 0, 0])
    with pytest.raises(ValueError, match="token_ids holds repeated ids"):
        load_draft_vocab(tmp_path, 2)
    write(token_ids=[1, 2.5], counts=[0, 0])
    with pytest.raises(ValueError, match="'token_ids' must be a list of integers"):
        load_draft_vocab(tmp_path, 2)
    write(ids=[1])
    with pytest.raises(ValueError, match="'token_ids' must be a list of integers"):
        check_draft_vocab_size(1, tmp_path)
    file.write_text(json.dumps({"format": "something-else", "token_ids": [1]}))
    with pytest.raises(ValueError, match="format must be 'blockdraft-draft-vocab/1', got 'something-else'"):
        check_draft_vocab_size(1, tmp_path)
    file.write_bytes(b"not json")
    with pytest.raises(ValueError, match="is not a readable draft vocabulary"):
        check_draft_vocab_size(1, tmp_path)


def test_resolve_uses_the_recorded_size_and_names_speculative_json(tmp_path):
    _write(tmp_path)
    assert resolve_draft_vocab_size(None, tmp_path) == 0  # no speculative.json: full vocabulary
    (tmp_path / "speculative.json").write_text(json.dumps({"num_speculative_tokens": 3, "draft_vocab_size": 4}))
    assert resolve_draft_vocab_size(None, tmp_path) == 4
    assert resolve_draft_vocab_size(0, tmp_path) == 0 and resolve_draft_vocab_size(6, tmp_path) == 6
    (tmp_path / "speculative.json").write_text(json.dumps({"draft_vocab_size": 60}))
    with pytest.raises(ValueError, match=r"size 60 recorded in .*speculative.json cannot be used: draft_vocab_size must be 0 .* \[1, 6\].*got 60.*draft_vocab_size 0 scores drafts"):
        resolve_draft_vocab_size(None, tmp_path)


@pytest.mark.parametrize("tied, pack", [(True, True), (False, False), (False, True)])
def test_lm_head_rows_score_like_compute_logits(tied, pack):
    """The accessor returns exactly the head rows, also when the untied head was packed away."""
    cfg = tiny_config("llama", tie_word_embeddings=tied)
    model = build_model(cfg, torch.float32, "cpu", pack_weights=pack)
    model.init_random_weights_(std=0.1, seed=3)
    ids = torch.tensor([7, 0, 95, 41])
    rows = model.lm_head_rows(ids)
    hidden = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(hidden @ rows.T, model.compute_logits(hidden)[:, ids], rtol=1e-5, atol=1e-5)
    if pack and not tied:
        assert model.lm_head.weight is None  # the rows came back through the packed matmul
    with pytest.raises(ValueError, match=r"ids in \[0, 96\)"):
        model.lm_head_rows(torch.tensor([96]))


def _spec(head=None, k=3):
    cfg = tiny_target_config()
    drafter = random_drafter(cfg, num_layers=2, block_size=4, seed=5, init_std=0.25)
    return DFlashSpeculator(drafter, TinyTarget(cfg), k, num_kv_blocks=16, kv_block_size=4, draft_head=head)


def _head(ids: torch.Tensor) -> DraftHead:
    return DraftHead(ids, TinyTarget(tiny_target_config()).lm_head.weight.detach()[ids])


def _propose(spec):
    """Context of two requests (lengths 9 and 13) then drafts -> ([R, K] drafts, [R, K, N] logits)."""
    table = shuffled_block_table(2, 8, seed=9)
    lens = (9, 13)
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(sum(lens), 2 * 64, generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    slots = torch.cat([slots_for(table[r], torch.arange(n), 4) for r, n in enumerate(lens)])
    bonus, bonus_pos = torch.tensor([5, 60]), torch.tensor(lens)
    drafts = spec.propose(feats, pos, slots, bonus, bonus_pos, table)
    return drafts, spec.draft_logits(bonus, bonus_pos, table)


def test_a_full_vocabulary_permutation_head_drafts_like_the_target_head():
    want, full = _propose(_spec())
    perm = torch.randperm(97, generator=torch.Generator().manual_seed(1))
    got, logits = _propose(_spec(_head(perm)))
    assert logits.shape == full.shape == (2, 3, 97)
    torch.testing.assert_close(logits, full[..., perm], rtol=1e-5, atol=1e-5)  # columns in draft-vocab order
    assert torch.equal(got, want)


def test_a_slice_drafts_the_argmax_of_the_full_logits_restricted_to_it():
    want_drafts, full = _propose(_spec())
    # A slice that leaves out most of the full-vocabulary drafts, so the mapping is exercised.
    keep = torch.tensor([t for t in range(97) if t not in set(want_drafts.flatten().tolist()[:4])])[::3]
    drafts, logits = _propose(_spec(_head(keep)))
    assert logits.shape == (2, 3, keep.numel())
    expected = keep[full[..., keep].argmax(dim=-1)]
    assert torch.equal(drafts, expected) and not torch.equal(drafts, want_drafts)
    assert set(drafts.flatten().tolist()) <= set(keep.tolist())


def test_output_multiplier_and_softcapping_apply_to_the_slice():
    cfg = tiny_target_config()
    ids = torch.arange(0, 97, 2)
    drafter = random_drafter(cfg, num_layers=1, block_size=4, seed=5, init_std=0.25, output_multiplier=0.5,
                             final_logit_softcapping=3.0)
    target = TinyTarget(cfg)
    hidden = torch.randn(4, 64)
    head = DraftHead(ids, target.lm_head.weight.detach()[ids])
    with torch.no_grad():
        full = drafter.compute_logits(hidden, target.compute_logits)
        sliced = drafter.compute_logits(hidden, head.logits)
    torch.testing.assert_close(sliced, full[:, ids], rtol=1e-5, atol=1e-5)
    assert float(full.abs().max()) <= 3.0


def test_the_speculator_refuses_a_head_that_does_not_fit():
    with pytest.raises(ValueError, match="draft head rows have hidden size 32, the drafter 64"):
        _spec(DraftHead(torch.arange(4), torch.zeros(4, 32)))
    with pytest.raises(ValueError, match=r"draft head holds id 200, outside the vocabulary \[0, 97\)"):
        _spec(DraftHead(torch.tensor([1, 200]), torch.zeros(2, 64)))


def test_engine_with_a_slice_emits_the_plain_greedy_output(tmp_path):
    """Folder drafter + draft_vocab.json through LLM (preflight, head built from the packed
    untied tiny target): token for token the plain output, drafts accepted, every draft in the slice."""
    from blockdraft.llm import LLM
    from blockdraft.sampling_params import SamplingParams
    from tests.server.tiny_model import write_tiny_drafter, write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    drafter = write_tiny_drafter(tmp_path / "drafter", model, block_size=4)
    prompts = [[{"role": "user", "content": f"w{i:02d}x w{i + 7:02d}x w{i + 20:02d}x"}] for i in range(1, 5)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    pool = dict(num_kv_blocks=128, kv_block_size=4)
    plain = LLM(model=str(model), **pool)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    # Rank the plain answers (as train-drafter ranks its data): the accepted drafts lie in the slice.
    ranked = rank_tokens([(torch.tensor(w), torch.ones(len(w), dtype=torch.bool)) for w in want], 96, (0,))
    save_draft_vocab(drafter, ranked[0], ranked[1], {"source": "plain answers", "num_tokens": ranked[2]})
    size = 12
    spec = LLM(model=str(model), draft=str(drafter), draft_vocab_size=size, **pool)
    head = spec.speculator.draft_head
    assert head.size == size and spec.target.model.lm_head.weight is None  # rows read back from the packed head
    drafted = []
    propose = spec.speculator.propose
    spec.speculator.propose = lambda *a, **kw: drafted.append(propose(*a, **kw)) or drafted[-1]
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.spec.num_accepted_tokens for o in outs) > 0
    assert set(torch.cat([d.flatten() for d in drafted]).tolist()) <= set(ranked[0][:size].tolist())


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_slice_stays_lossless_across_k_batch_sizes_sampling_and_stops(tmp_path, k, temperature):
    """Speculation with a draft vocabulary == plain decoding, token for token and finish reason:
    K = 1 / 3 / 7, batches of 1 and 4, greedy and seeded sampling, a stop token id that falls
    inside a verify block, and max_tokens inside a block."""
    from blockdraft.llm import LLM
    from blockdraft.sampling_params import SamplingParams
    from tests.server.tiny_model import write_tiny_drafter, write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    drafter = write_tiny_drafter(tmp_path / "drafter", model, block_size=8)
    prompts = [[{"role": "user", "content": f"w{i:02d}x w{i + 3:02d}x w{i + 11:02d}x"}] for i in range(1, 5)]
    pool = dict(num_kv_blocks=128, kv_block_size=4)
    plain = LLM(model=str(model), **pool)
    base = [SamplingParams(max_tokens=21, ignore_eos=True, temperature=temperature, seed=5 + i) for i in range(4)]
    long = plain.generate(prompts, base)
    ranked = rank_tokens([(torch.tensor(o.token_ids), torch.ones(len(o.token_ids), dtype=torch.bool)) for o in long], 96)
    save_draft_vocab(drafter, ranked[0], ranked[1], {"source": "plain answers", "num_tokens": ranked[2]})
    # a stop id met mid-answer by the first request (position 6), so it lands inside a block
    stop = long[0].token_ids[6]
    params = [SamplingParams(max_tokens=21 - 2 * i, ignore_eos=True, temperature=temperature, seed=5 + i,
                             stop_token_ids=[stop] if i == 0 else []) for i in range(4)]
    want = plain.generate(prompts, params)
    assert want[0].finish_reason == "stop" and want[0].token_ids[-1] == stop
    spec = LLM(model=str(model), draft=str(drafter), num_speculative_tokens=k, draft_vocab_size=16, **pool)
    for bs in (1, 4):
        outs = spec.generate(prompts[:bs], params[:bs])
        assert [(o.token_ids, o.finish_reason) for o in outs] == [(w.token_ids, w.finish_reason) for w in want[:bs]]
    # the tiny drafter accepts little (2 drafts here); verification with many accepted drafts and
    # stops inside them is pinned by tests/spec/test_lossless.py, this test pins the slice path
    stats = spec.engine.stats.spec
    assert stats.num_steps > 0 and stats.num_accepted_tokens > 0
