"""The near-tie check of DFlash-vs-plain divergences: the top-2 gap at the first divergent token."""

import pytest
import torch

from blockdraft.bench.measure import Cell, compare_outputs
from blockdraft.bench.near_ties import NEAR_TIE_GAP, divergence_gaps
from blockdraft.bench.suite import Settings, add_divergence_gaps
from blockdraft.bench.workload import Workload
from blockdraft.sampling_params import SamplingParams
from tests.conftest import make_llm, random_prompts, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", seed=11)


def _greedy(llm, prompts, n):
    return [list(o.token_ids) for o in llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))]


def _top(llm, prompt, n=5):
    out = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True, logprobs=n))[0]
    return out.logprobs[0]["top"]


def test_gap_at_the_first_divergence_of_each_mismatched_request(target):
    llm = make_llm(target)
    prompts = random_prompts(3, seed=4)
    reference = _greedy(llm, prompts, 8)
    top = _top(llm, prompts[0] + reference[0][:3])
    assert top[0][0] == reference[0][3]
    third = _top(llm, prompts[1] + reference[1][:5])[2][0]
    candidate = [
        reference[0][:3] + [top[1][0]] + reference[0][4:],  # the runner-up: a top-2 divergence at 3
        reference[1][:5] + [third] + reference[1][6:],  # a token outside the top two at 5
        list(reference[2]),  # identical
    ]
    first = compare_outputs(candidate, reference)["first_mismatch"]
    assert first == [3, 5, None]
    got = divergence_gaps(llm, prompts, candidate, reference, first)
    assert [(g["request"], g["index"]) for g in got] == [(0, 3), (1, 5)]
    assert got[0]["both_in_top2"] and got[0]["top2_tokens"] == [top[0][0], top[1][0]]
    assert got[0]["top2_gap"] == pytest.approx(top[0][1] - top[1][1], abs=1e-6)
    assert got[0]["near_tie"] == (got[0]["top2_gap"] < NEAR_TIE_GAP)
    assert got[0]["reference_token"] == reference[0][3] and got[0]["candidate_token"] == top[1][0]
    assert not got[1]["both_in_top2"] and not got[1]["near_tie"]
    assert got[0]["pair_gap"] == pytest.approx(got[0]["top2_gap"], abs=1e-6)  # the top two: the same gap
    top1 = dict(_top(llm, prompts[1] + reference[1][:5], n=20))
    assert got[1]["pair_gap"] == pytest.approx(top1[reference[1][5]] - top1[third], abs=1e-4)  # another batch


def test_a_divergent_token_below_the_top_20_still_gets_its_pair_gap(target):
    """A grammar can force a token the unconstrained model ranks low: its log-prob is read by
    scoring it as a prompt token, so pair_gap (and fp32_picks) are numbers, never missing."""
    vocab = target.config.vocab_size
    full = make_llm(target, max_logprobs=vocab)
    prompts = random_prompts(1, seed=7)
    reference = _greedy(full, prompts, 6)
    ranked = _top(full, prompts[0] + reference[0][:2], n=vocab)
    low = ranked[-1][0]  # the least likely token, far below the top 20
    candidate = [reference[0][:2] + [low] + reference[0][3:]]
    first = compare_outputs(candidate, reference)["first_mismatch"]
    (got,) = divergence_gaps(make_llm(target), prompts, candidate, reference, first, make_llm(target), constrained=True)
    lp = dict(ranked)
    assert got["pair_gap"] == pytest.approx(lp[reference[0][2]] - lp[low], abs=1e-4)
    assert got["pair_gap_fp32"] == pytest.approx(got["pair_gap"], abs=1e-4) and got["fp32_picks"] == "reference"
    assert not got["near_tie"] and got["top2_tokens"] == [ranked[0][0], ranked[1][0]]


def test_constrained_divergences_are_judged_by_the_two_tokens_gap(target, monkeypatch):
    """Under a grammar each path picks the best token it allows, so the unconstrained top two say
    nothing: with constrained=True a divergence to the third-ranked token is a near-tie when the
    two divergent tokens' own gap is under the bound (raised here above that gap)."""
    from blockdraft.bench import near_ties

    llm = make_llm(target)
    prompts = random_prompts(1, seed=4)
    reference = _greedy(llm, prompts, 8)
    third = _top(llm, prompts[0] + reference[0][:5])[2][0]
    candidate = [reference[0][:5] + [third] + reference[0][6:]]
    first = compare_outputs(candidate, reference)["first_mismatch"]
    (plain,) = divergence_gaps(llm, prompts, candidate, reference, first)
    monkeypatch.setattr(near_ties, "NEAR_TIE_GAP", plain["pair_gap"] + 1e-3)
    (loose,) = divergence_gaps(llm, prompts, candidate, reference, first)
    (masked,) = divergence_gaps(llm, prompts, candidate, reference, first, constrained=True)
    assert not loose["near_tie"]  # not the top two: never a tie unconstrained
    assert masked["near_tie"] and masked["pair_gap"] == pytest.approx(plain["pair_gap"])
    monkeypatch.setattr(near_ties, "NEAR_TIE_GAP", plain["pair_gap"] - 1e-3)
    assert not divergence_gaps(llm, prompts, candidate, reference, first, constrained=True)[0]["near_tie"]


def test_a_float32_copy_of_the_target_judges_the_same_divergences(target):
    """With llm_fp32 each divergence also gets the float32 target's top two and gap (here a bf16
    copy is the engine under test and the float32 target the reference: their gaps differ by
    bf16 rounding only)."""
    import dataclasses

    bf16 = dataclasses.replace(target, model=tiny_target("qwen3", seed=11).model.to(torch.bfloat16))
    llm, llm_fp32 = make_llm(bf16), make_llm(target)
    prompts = random_prompts(2, seed=4)
    reference = _greedy(llm, prompts, 8)
    runner_up = _top(llm, prompts[0] + reference[0][:2])[1][0]
    candidate = [reference[0][:2] + [runner_up] + reference[0][3:], list(reference[1])]
    first = compare_outputs(candidate, reference)["first_mismatch"]
    (got,) = divergence_gaps(llm, prompts, candidate, reference, first, llm_fp32)
    top32 = _top(llm_fp32, prompts[0] + reference[0][:2])
    assert got["top2_tokens_fp32"] == [top32[0][0], top32[1][0]]
    assert got["top2_gap_fp32"] == pytest.approx(top32[0][1] - top32[1][1], abs=1e-6)
    assert got["top2_gap_fp32"] != got["top2_gap"]  # bf16 rounding moved it
    assert got["near_tie_fp32"] == (set(got["top2_tokens_fp32"]) == {reference[0][2], runner_up}
                                    and got["top2_gap_fp32"] < NEAR_TIE_GAP)
    assert "top2_gap_fp32" not in divergence_gaps(llm, prompts, candidate, reference, first)[0]
    lp32 = dict(_top(llm_fp32, prompts[0] + reference[0][:2], n=20))
    picks = "candidate" if lp32[runner_up] > lp32[reference[0][2]] else "reference"
    assert got["fp32_picks"] == picks
    assert got["pair_gap_fp32"] == pytest.approx(abs(lp32[runner_up] - lp32[reference[0][2]]), abs=1e-4)


def test_length_only_differences_and_equal_outputs_are_skipped(target):
    llm = make_llm(target)
    prompts = random_prompts(2, seed=5)
    reference = _greedy(llm, prompts, 6)
    candidate = [reference[0][:4], list(reference[1])]
    first = compare_outputs(candidate, reference)["first_mismatch"]
    assert first == [4, None]
    assert divergence_gaps(llm, prompts, candidate, reference, first) == []


def test_suite_marks_the_dflash_rows_with_their_divergences(target):
    prompts = random_prompts(2, seed=6)
    reference = _greedy(make_llm(target), prompts, 6)
    runner_up = _top(make_llm(target), prompts[1] + reference[1][:2])[1][0]
    candidate = [list(reference[0]), reference[1][:2] + [runner_up] + reference[1][3:]]
    workload = Workload("tiny", torch.device("cpu"), torch.float32, None, target, None, prompts)
    cells = [Cell("ours", mode, 2, 2, token_ids=ids) for mode, ids in (("plain", reference), ("dflash", candidate))]
    parity = [
        {"batch_size": 2, "candidate": "ours/dflash", "reference": "ours/plain", **compare_outputs(candidate, reference)},
        {"batch_size": 2, "candidate": "hf/plain", "reference": "ours/plain", **compare_outputs(candidate, reference)},
    ]
    add_divergence_gaps(workload, Settings((2,), 6), cells, parity)
    assert [d["request"] for d in parity[0]["divergences"]] == [1]
    assert parity[0]["near_ties"] == int(parity[0]["divergences"][0]["near_tie"])
    assert "divergences" not in parity[1]  # only our DFlash against our plain decoding is checked


def test_suite_judges_a_bf16_target_from_a_folder_in_float32_too(tmp_path):
    """A bf16 target loaded from a folder: the suite loads it again in float32 and counts the
    float32 near-ties beside the bf16 ones; the table shows both."""
    from blockdraft.bench.report import _mismatch_tag
    from blockdraft.llm import load_target
    from tests.server.tiny_model import write_tiny_model

    target = load_target(str(write_tiny_model(tmp_path / "m")), dtype="bfloat16")
    prompts = random_prompts(2, seed=6)
    reference = _greedy(make_llm(target), prompts, 6)
    runner_up = _top(make_llm(target), prompts[1] + reference[1][:2])[1][0]
    candidate = [list(reference[0]), reference[1][:2] + [runner_up] + reference[1][3:]]
    workload = Workload("tiny", torch.device("cpu"), torch.bfloat16, None, target, None, prompts)
    cells = [Cell("ours", mode, 2, 2, token_ids=ids) for mode, ids in (("plain", reference), ("dflash", candidate))]
    parity = [{"batch_size": 2, "candidate": "ours/dflash", "reference": "ours/plain",
               "num_requests": 2, **compare_outputs(candidate, reference)}]  # fmt: skip
    add_divergence_gaps(workload, Settings((2,), 6), cells, parity)
    (d,) = parity[0]["divergences"]
    assert {"top2_gap_fp32", "top2_tokens_fp32", "near_tie_fp32"} <= set(d)
    assert parity[0]["near_ties_fp32"] == int(d["near_tie_fp32"])
    assert parity[0]["fp32_picks_dflash"] == int(d["fp32_picks"] == "candidate")
    assert _mismatch_tag(parity[0]).endswith(f"in fp32; {parity[0]['fp32_picks_dflash']} fp32 = dflash)")
