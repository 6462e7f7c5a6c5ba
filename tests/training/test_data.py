"""Prompt selection, contamination checks, the on-disk dataset, and batching."""

import json

import pytest
import torch

from blockdraft.training import corpora
from blockdraft.training.dataset import TokenDataset, collate, epoch_batches
from blockdraft.training.generate import cut_at_eos, sampling_plan
from blockdraft.training.prompts import EvalIndex, assert_no_eval_overlap, select_later_turns, select_prompts
from blockdraft.weights.fetch import cache_root, find_wheel

EVAL = ["Write a function that returns the sum of the squares of all odd numbers in a list of integers please",
        "Compose an engaging travel blog post about a recent trip to Hawaii."]


def test_iter_json_array_stops_at_a_truncated_record():
    text = json.dumps([{"a": 1}, {"b": [1, 2]}, {"c": "x"}])[:-8]
    assert list(corpora.iter_json_array(text)) == [{"a": 1}, {"b": [1, 2]}]


def test_select_prompts_filters_dedups_and_drops_eval_overlap():
    texts = ["hi", "Explain how a hash map works.", "explain  how a HASH map works.", "短" * 40,
             "compose an engaging travel blog post about a recent trip to hawaii.",
             "Please: write a function that returns the sum of the squares of all odd numbers in a list, thanks"]
    kept, stats = select_prompts(texts, EVAL, 10)
    assert kept == ["Explain how a hash map works."]
    assert stats == {"input": 6, "length": 1, "non_ascii": 1, "duplicate": 1, "eval_overlap": 2, "kept": 1}
    with pytest.raises(ValueError, match="overlaps"):
        assert_no_eval_overlap(texts[4:5], EVAL)


def _conv(*texts):
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]


def test_later_turns_are_prefixes_ending_in_a_later_user_turn_with_eval_text_nowhere():
    convs = [
        _conv("What is a Python list?", "A sequence.", "And how do I sort one?", "sorted(x).", "Reverse it too, please?"),
        _conv("Tell me a joke please", EVAL[1], "Another one, thanks!"),  # eval text in an assistant turn
        _conv("Only one question here"),
        _conv("What is a Python list?", "A sequence.", "And how do I sort one?"),  # duplicate prefix
    ]
    kept, stats = select_later_turns(convs, EVAL, 100, seed=0)
    got = sorted([m["content"] for m in p] for p in kept)
    assert got == [[m["content"] for m in convs[0][:3]], [m["content"] for m in convs[0]]]
    assert stats == {"input": 4, "length": 0, "non_ascii": 0, "duplicate": 1, "eval_overlap": 1, "kept": 2}
    assert_no_eval_overlap(kept, EVAL)
    with pytest.raises(ValueError, match="overlaps an evaluation prompt"):
        assert_no_eval_overlap([convs[1]], EVAL)


def test_eval_index_uses_word_shingles():
    idx = EvalIndex(EVAL, n=5)
    assert idx.overlaps("so: the sum of the squares of all odd numbers, ok?")
    assert not idx.overlaps("the sum of squares")


def test_dataset_round_trip_and_batches(tmp_path):
    data = TokenDataset.from_pairs([([1, 2], [3, 4, 5]), ([6], [7])], [False, True], {"k": 1})
    data.save(tmp_path)
    back = TokenDataset.load(tmp_path)
    assert back.info == {"k": 1} and back.lengths().tolist() == [5, 2] and back.sampled.tolist() == [0, 1]
    ids, mask = back.sequence(0)
    assert ids.tolist() == [1, 2, 3, 4, 5] and mask.tolist() == [False, False, True, True, True]
    b = collate(back, [0, 1], max_len=4)
    assert b.input_ids.tolist() == [[1, 2, 3, 4], [6, 7, 0, 0]] and b.lengths.tolist() == [4, 2]
    assert b.loss_mask.tolist() == [[False, False, True, True], [False, True, False, False]]
    batches = epoch_batches(torch.tensor([5, 9, 3, 7, 1]), 2, seed=0, epoch=0)
    assert sorted(i for bt in batches for i in bt) == [0, 1, 2, 3, 4]
    assert batches == epoch_batches(torch.tensor([5, 9, 3, 7, 1]), 2, seed=0, epoch=0)


def test_a_folder_of_shards_loads_as_one_dataset_with_whole_counts(tmp_path):
    first = TokenDataset.from_pairs([([1, 2], [3, 4, 5]), ([6], [7])], [False, True], {"num_sequences": 2, "k": 1})
    second = TokenDataset.from_pairs([([8], [9, 10])], [True], {"num_sequences": 1, "k": 2})
    first.save(tmp_path, shard=0)
    second.save(tmp_path, shard=1)
    both = TokenDataset.load(tmp_path)
    assert both.lengths().tolist() == [5, 2, 3] and both.sequence(2)[0].tolist() == [8, 9, 10]
    assert both.info["k"] == 1 and [s["k"] for s in both.info["shards"]] == [1, 2]
    assert (both.info["num_sequences"], both.info["num_tokens"], both.info["num_response_tokens"],
            both.info["num_sampled"]) == (3, 10, 6, 2)


def test_generation_helpers():
    assert cut_at_eos([5, 6, 2, 7], (2,)) == [5, 6, 2] and cut_at_eos([5], (2,)) == [5]
    plan = sampling_plan(20, 0.25, seed=3)
    assert sum(plan) == 5 and plan == sampling_plan(20, 0.25, seed=3)


def _have_wheels() -> bool:
    downloads = cache_root() / "downloads"
    return all(find_wheel(downloads, w.package, w.version) for w in (corpora.SHAREGPT, corpora.HUMANEVAL, corpora.MTBENCH))


@pytest.mark.skipif(not _have_wheels(), reason="ShareGPT / HumanEval / MT-bench wheels not in the cache")
def test_real_training_prompts_contain_no_eval_prompt():
    eval_texts = corpora.all_eval_texts()
    assert len(corpora.humaneval_problems()) == 164 and len(corpora.mtbench_questions()) == 80
    # Plant the eval prompts among the ShareGPT turns: every one of them must be filtered out.
    planted = corpora.sharegpt_first_turns() + eval_texts
    kept, stats = select_prompts(planted, eval_texts, 10**6)
    assert stats["eval_overlap"] >= len(set(eval_texts)) - stats["duplicate"] - stats["length"]
    assert_no_eval_overlap(kept, eval_texts)
    index = EvalIndex(eval_texts)
    assert not any(index.overlaps(t) for t in kept)
    assert len(kept) > 5000
    # Multi-turn prefixes, with the eval prompts planted as later user turns and as assistant turns.
    convs = corpora.sharegpt_conversations()
    planted = convs + [_conv("Hello there, friend", "Hi!", t) for t in eval_texts] + [_conv("Hi there friend", t, "Ok")
                                                                                      for t in eval_texts]
    later, stats = select_later_turns(planted, eval_texts, 10**6)
    assert_no_eval_overlap(later, eval_texts)
    assert stats["eval_overlap"] >= len(set(eval_texts)) and len(later) > 10000
