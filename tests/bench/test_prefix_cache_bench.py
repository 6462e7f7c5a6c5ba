"""`python -m blockdraft.bench.prefix_cache` on the tiny target with a DFlash drafter: the cache is
hit on the shared system prompt and every answer equals the one without the cache."""

import json

from blockdraft.bench import prefix_cache
from tests.server.tiny_model import write_tiny_drafter, write_tiny_model


def test_shared_system_prompt_is_served_from_the_cache_with_the_same_answers(tmp_path, capsys):
    model = write_tiny_model(tmp_path / "model")
    drafter = write_tiny_drafter(tmp_path / "drafter", model)
    args = ["--model", str(model), "--draft", str(drafter), "--system-tokens", "64", "--max-tokens", "4",
            "--num-questions", "2", "--json", str(tmp_path / "r.json")]
    assert prefix_cache.main(args) == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["identical"] and len(doc["requests"][prefix_cache.ON]) == 2
    # every timed question reuses the system prompt's full pages (the warm-up filled them)
    assert doc["prefix_cache_hits"] >= 2 * 64 // 16 * 16
    assert "prefix caching on" in capsys.readouterr().out


def test_question_count_out_of_range_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        prefix_cache.main(["--num-questions", "0"])
    assert "--num-questions must be in [1, 6], got 0" in capsys.readouterr().err


def test_engines_run_on_the_device_asked_for_and_warmup_rounds_count_no_hits(tmp_path, monkeypatch):
    """Both engines get --device (they ran on the CPU with --device cuda, against GPU weights),
    and a warm-up round (the cache reset after it) changes neither the timed round's answers nor
    its counted cache hits."""
    import blockdraft.llm

    model = write_tiny_model(tmp_path / "model")
    drafter = write_tiny_drafter(tmp_path / "drafter", model)
    devices = []
    real_llm = blockdraft.llm.LLM

    def recording_llm(*args, **kwargs):
        devices.append(kwargs.get("device"))
        return real_llm(*args, **kwargs)

    monkeypatch.setattr(blockdraft.llm, "LLM", recording_llm)
    docs = []
    for rounds in (0, 1):
        out = tmp_path / f"r{rounds}.json"
        args = ["--model", str(model), "--draft", str(drafter), "--system-tokens", "64", "--max-tokens", "4",
                "--num-questions", "2", "--warmup-rounds", str(rounds), "--device", "cpu", "--json", str(out)]
        assert prefix_cache.main(args) == 0
        docs.append(json.loads(out.read_text()))
    assert devices == ["cpu"] * 4
    assert docs[0]["prefix_cache_hits"] == docs[1]["prefix_cache_hits"] > 0
    assert docs[0]["prefix_cache_queries"] == docs[1]["prefix_cache_queries"]



def test_divergences_report_the_top2_gap_of_the_reference_at_the_first_differing_token():
    from types import SimpleNamespace as NS

    from blockdraft.sampling_params import SamplingParams

    asked = []

    class Reference:  # the cache-off engine asked again with logprobs
        def generate(self, messages, params):
            asked.append((messages[1]["content"], params.logprobs))
            tops = [[(5, -0.1), (6, -2.0)], [(7, -0.693), (8, -0.700)], [(9, -0.1), (1, -3.0)]]
            return [NS(token_ids=[5, 7, 9], logprobs=[{"top": t} for t in tops])]

    same, differs = NS(token_ids=[5, 7, 9]), NS(token_ids=[5, 8, 9])
    outputs = {prefix_cache.OFF: [same, same], prefix_cache.ON: [same, differs]}
    found = prefix_cache.divergences(Reference(), "sys", outputs, SamplingParams(max_tokens=3))
    assert asked == [(prefix_cache.QUESTIONS[2], 2)]  # only the differing question, with top-2
    (d,) = found
    assert (d["question"], d["index"], d["off_token"], d["on_token"]) == (2, 1, 7, 8)
    assert abs(d["top2_gap"] - 0.007) < 1e-9 and d["near_tie"]
    outputs[prefix_cache.ON][1] = NS(token_ids=[6, 7, 9])  # differs where the gap is 1.9
    assert not prefix_cache.divergences(Reference(), "sys", outputs, SamplingParams(max_tokens=3))[0]["near_tie"]
