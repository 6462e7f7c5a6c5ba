"""`blockdraft generate --logprobs N`: the target's log-probabilities of the output tokens and their
N most likely alternatives, as a `logprobs` list with --json (the server's chat items plus ids) or a
table after the answer; the same with DFlash as with plain decoding; bad values refused before loading."""

from __future__ import annotations

import json

import pytest

from blockdraft.cli import main
from blockdraft.sampling_params import DEFAULT_MAX_LOGPROBS
from tests.server.tiny_model import word, write_tiny_model_and_drafter

# Greedy from this raw prompt the tiny model emits a run of the token the tiny drafter proposes
# (w45x), so drafts get accepted and logprobs come from verify rows, not only from one-row steps.
PROMPT = word(17)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model_and_drafter(tmp_path_factory.mktemp("tiny"))


def _generate(capsys, model, *flags) -> tuple[int, str, str]:
    code = main(["generate", PROMPT, "--raw", "--model", str(model), "--max-tokens", "16", *flags])
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys, model, *flags) -> dict:
    code, out, err = _generate(capsys, model, "--json", *flags)
    assert code == 0, err
    return json.loads(out)


def test_json_has_the_sampled_token_and_n_alternatives_per_output_token(tiny, capsys):
    model, _ = tiny
    result = _json(capsys, model, "--no-draft", "--logprobs", "3")
    items = result["logprobs"]
    assert [e["token_id"] for e in items] == result["token_ids"] and len(items) == 16
    assert "".join(e["token"] + " " for e in items).strip() == result["text"]  # word tokens, space-joined
    for e in items:
        assert e["token"] == word(e["token_id"]) and e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 3 and e["logprob"] <= 0
        assert set(e["top_logprobs"][0]) == {"token_id", "token", "logprob", "bytes"}
        tops = [t["logprob"] for t in e["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and all(t["token"] == word(t["token_id"]) for t in e["top_logprobs"])
        # greedy: the sampled token is the most likely one
        assert all(e["logprob"] >= lp for lp in tops) and e["top_logprobs"][0]["token_id"] == e["token_id"]
    zero = _json(capsys, model, "--no-draft", "--logprobs", "0")["logprobs"]  # only the sampled token's
    assert [e["top_logprobs"] for e in zero] == [[]] * 16
    assert [e["logprob"] for e in zero] == pytest.approx([e["logprob"] for e in items], abs=1e-6)
    assert "logprobs" not in _json(capsys, model, "--no-draft")  # not asked: the output is as before


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.8", "--seed", "3"]], ids=["greedy", "seeded-t0.8"])
def test_dflash_logprobs_equal_plain_decoding_token_for_token(tiny, capsys, sampling):
    """The logprobs are the target's: a DFlash run (drafts accepted when greedy) gives those of
    --no-draft, greedy and seeded sampling alike (logprobs of the raw logits, before temperature)."""
    model, drafter = tiny
    spec = _json(capsys, model, "--draft", str(drafter), "--logprobs", "5", *sampling)
    plain = _json(capsys, model, "--no-draft", "--logprobs", "5", *sampling)
    if not sampling:
        assert spec["num_accepted_tokens"] > 0, "no draft accepted: pick another PROMPT (see the comment)"
    assert spec["num_drafted_tokens"] > 0  # it speculated
    assert plain["num_speculative_tokens"] is None
    assert spec["token_ids"] == plain["token_ids"] and len(spec["logprobs"]) == len(plain["logprobs"]) == 16
    for s, p in zip(spec["logprobs"], plain["logprobs"]):
        assert (s["token_id"], s["token"]) == (p["token_id"], p["token"])
        assert [t["token_id"] for t in s["top_logprobs"]] == [t["token_id"] for t in p["top_logprobs"]]
        assert [s["logprob"], *(t["logprob"] for t in s["top_logprobs"])] == \
            pytest.approx([p["logprob"], *(t["logprob"] for t in p["top_logprobs"])], abs=1e-4)


def test_text_output_prints_a_table_after_the_answer(tiny, capsys):
    model, _ = tiny
    ref = _json(capsys, model, "--no-draft", "--logprobs", "2")
    code, out, err = _generate(capsys, model, "--no-draft", "--logprobs", "2")
    assert code == 0, err
    answer, header, *rows = out.rstrip("\n").split("\n")
    assert answer == ref["text"] and header.startswith("--- logprobs") and len(rows) == 16
    for i, (row, e) in enumerate(zip(rows, ref["logprobs"])):
        fields = row.split()
        assert fields[:4] == [str(i), f'"{e["token"]}"', str(e["token_id"]), f"{e['logprob']:.4f}"]
        assert fields[4:] == [f'"{t["token"]}"={t["logprob"]:.4f}' for t in e["top_logprobs"]]
    assert err.strip().splitlines()[-1].startswith("[16 tokens in ")  # the summary stays on stderr
    code, out, _ = _generate(capsys, model, "--no-draft")
    assert code == 0 and out.strip() == ref["text"]  # no table unless asked


@pytest.mark.parametrize("value, message", [
    ("-1", "logprobs (--logprobs) must be an integer >= 0, got -1"),
    (str(DEFAULT_MAX_LOGPROBS + 1), f"logprobs (--logprobs) must be <= {DEFAULT_MAX_LOGPROBS} (the engine's "
                                    f"max_logprobs; vLLM's default, fixed for the CLI), got {DEFAULT_MAX_LOGPROBS + 1}"),
])
def test_bad_values_are_refused_before_the_model_loads(value, message, capsys):
    assert main(["generate", "hi", "--model", "/nonexistent-model", "--logprobs", value]) == 2
    err = capsys.readouterr().err
    assert message in err and "nonexistent" not in err, err


def test_stop_and_ignore_eos_flags_reach_the_request(tiny, capsys, monkeypatch):
    """generate --stop STR (repeatable) and --ignore-eos, as SamplingParams' stop / ignore_eos."""
    from blockdraft.engine.llm_engine import LLMEngine

    model, _ = tiny
    seen, add = [], LLMEngine.add_request

    def spy(self, request_id, prompt, params, *a, **kw):
        seen.append(params)
        return add(self, request_id, prompt, params, *a, **kw)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    whole = _json(capsys, model, "--no-draft")
    words = whole["text"].split()
    assert len(words) >= 4, whole["text"]
    cut = _json(capsys, model, "--no-draft", "--stop", "nothing-like-this", "--stop", words[3])
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == words[3]
    assert cut["text"] == whole["text"][: whole["text"].index(words[3])]
    assert seen[-1].stop == ["nothing-like-this", words[3]] and not seen[-1].ignore_eos
    assert _json(capsys, model, "--no-draft", "--ignore-eos")["finish_reason"] == "length"
    assert seen[-1].ignore_eos and not seen[-1].stop
    code, _, err = _generate(capsys, model, "--stop", "")
    assert code == 2 and "stop" in err
    # streamed, a stop string spanning two tokens must not show its first part before it matches
    stop = words[2] + " " + words[3]
    for extra in ([], ["--draft", str(tiny[1])]):
        code, out, err = _generate(capsys, model, *(extra or ["--no-draft"]), "--stream", "--stop", stop)
        assert code == 0, err
        assert out.startswith(whole["text"][: whole["text"].index(stop)] + "\n"), out


def test_help_names_the_range_and_both_outputs():
    from blockdraft.cli import _command, _parser

    text = " ".join(_command(_parser(), "generate").format_help().split())  # one line: no wrapping breaks
    assert f"alternatives, 0 <= N <= {DEFAULT_MAX_LOGPROBS}" in text
    assert "a table after the answer (one line per token), or a 'logprobs' list with --json" in text


def test_table_pads_the_token_column_by_display_width():
    """Wide characters (CJK, emoji) take two terminal columns, combining marks none: the token
    column is padded to 16 columns on screen, not 16 code points, so the id column lines up."""
    from blockdraft.cli import _logprob_table

    tokens = {"a": 3, "日本語": 8, "🙂x": 5, "e\u0301": 3, "ＡＢ": 6}  # token -> columns of its quoted text
    items = [{"token_id": 10 + i, "token": t, "logprob": -0.5, "top_logprobs": [{"token": t, "logprob": -0.5}]}
             for i, t in enumerate(tokens)]
    rows = _logprob_table(items)[1:]
    for i, (row, (t, width)) in enumerate(zip(rows, tokens.items())):
        assert row == f'{i:>4}  "{t}"{" " * (16 - width)} {10 + i:>7}  {-0.5:>9.4f}  "{t}"=-0.5000'


def test_prompt_logprobs_json_and_table(tiny, capsys):
    """--prompt-logprobs N: a 'prompt_logprobs' list with --json (null first, then the chat items
    plus ids, as --logprobs; the same with DFlash as without), a table after the answer otherwise."""
    model, drafter = tiny
    prompt = " ".join(word(i) for i in (17, 4, 60, 23))
    flags = ["--raw", "--model", str(model), "--max-tokens", "4", "--prompt-logprobs", "2"]
    runs = {}
    for name, extra in (("plain", ["--no-draft"]), ("spec", ["--draft", str(drafter)])):
        assert main(["generate", prompt, *flags, *extra, "--json"]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    items = runs["plain"]["prompt_logprobs"]
    assert items[0] is None and [e["token"] for e in items[1:]] == prompt.split()[1:]
    for e in items[1:]:
        assert len(e["top_logprobs"]) == 2 and e["logprob"] <= e["top_logprobs"][0]["logprob"] <= 0
    assert "logprobs" not in runs["plain"]  # only what was asked for
    assert runs["spec"]["token_ids"] == runs["plain"]["token_ids"]
    assert [e["logprob"] for e in runs["spec"]["prompt_logprobs"][1:]] == pytest.approx(
        [e["logprob"] for e in items[1:]], abs=1e-4)
    assert main(["generate", prompt, *flags, "--no-draft"]) == 0
    assert len(runs["plain"]["prompt_token_ids"]) == len(items)  # entry i scores prompt token i
    assert [runs["plain"]["prompt_token_ids"][i] for i in range(1, len(items))] == [e["token_id"] for e in items[1:]]
    answer, header, first, *rows = capsys.readouterr().out.rstrip("\n").split("\n")
    assert answer == runs["plain"]["text"] and header.startswith("--- prompt logprobs of the target model")
    # row 0: the first prompt token, which nothing before it scores
    assert first.split()[:4] == ["0", f'"{word(17)}"', str(runs["plain"]["prompt_token_ids"][0]), "-"]
    assert [r.split()[:4] for r in rows] == [[str(i), f'"{e["token"]}"', str(e["token_id"]), f"{e['logprob']:.4f}"]
                                             for i, e in enumerate(items[1:], 1)]


def test_prompt_logprobs_bad_value_is_refused_before_the_model_loads(capsys):
    assert main(["generate", "hi", "--model", "/nonexistent-model", "--prompt-logprobs", "21"]) == 2
    err = capsys.readouterr().err
    assert f"prompt_logprobs (--prompt-logprobs) must be <= {DEFAULT_MAX_LOGPROBS}" in err and "nonexistent" not in err
