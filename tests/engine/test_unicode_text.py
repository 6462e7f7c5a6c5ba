"""Text that is not valid Unicode (a lone surrogate: what non-UTF-8 bytes of a command line become,
0xE9 -> U+DCE9) is refused by name before it reaches the tokenizer, whose own error is a bare
TypeError (a fresh-user trial got that traceback from `generate $'caf\\xe9'`)."""

from __future__ import annotations

import pytest

from blockdraft.llm import LLM
from blockdraft.sampling_params import SamplingParams
from tests.server.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return LLM(model=str(write_tiny_model(tmp_path_factory.mktemp("unicode") / "model")))


def test_prompts_and_messages_with_a_lone_surrogate_are_refused_naming_them(llm):
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match=r"^prompt 1 is not valid Unicode text: a lone surrogate U\+D800 at "
                                         r"character 5; give UTF-8 text"):
        llm.generate(["w05x", "w05x \ud800"], params)
    with pytest.raises(ValueError, match=r"^prompt 0 is not valid Unicode text: byte 0xE9, which is not UTF-8, at "
                                         r"character 3"):
        llm.generate({"prompt": "caf\udce9"}, params)
    conv = [{"role": "user", "content": "w05x"}, {"role": "assistant", "content": "w06x"},
            {"role": "user", "content": [{"type": "text", "text": "w07x \udcff"}]}]
    with pytest.raises(ValueError, match=r"^message 2 is not valid Unicode text: byte 0xFF") as e:
        llm.chat(conv, params)
    assert e.value.param == "messages"  # the server's 400 names the field
    with pytest.raises(ValueError, match=r"^chat_template_kwargs is not valid Unicode text"):
        llm.chat(conv[:1], params, chat_template_kwargs={"x": "\ud800"})
    # valid text outside the BMP (a surrogate pair in UTF-16, one code point here) is fine
    assert llm.generate("w05x 😀", params)[0].finish_reason in ("length", "stop")


def test_a_stop_string_that_is_not_valid_unicode_is_refused():
    with pytest.raises(ValueError, match=r"^stop string '\\udcff' is not valid Unicode text: byte 0xFF") as e:
        SamplingParams(stop=["ok", "\udcff"])
    assert e.value.param == "stop"


@pytest.mark.parametrize("command", ["generate", "demo"])
def test_cli_refuses_a_prompt_of_bytes_that_are_not_utf8_before_loading(capsys, monkeypatch, command):
    import blockdraft.model_loader
    from blockdraft.cli import main

    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded"))
    assert main([command, "caf\udce9", "--model", "/nonexistent-model"]) == 2  # said before the model is looked for
    err = capsys.readouterr().err
    what = "the prompt" if command == "generate" else "prompt 1"
    assert f"error: {what} is not valid Unicode text: byte 0xE9, which is not UTF-8, at character 3; give UTF-8 " \
           f"text (e.g. convert a Latin-1 file with `iconv -f latin1 -t utf-8`)" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("kw, field", [
    (dict(regex="a\ud800"), "regex"),
    (dict(choice=["yes", "caf\udce9"]), "choice"),
    (dict(grammar='start: "\ud800"'), "grammar"),
    (dict(json={"type": "object"}, whitespace_pattern="\ud800"), "whitespace_pattern"),
    (dict(json={"type": "object", "properties": {"k\ud800": {}}}), "json"),  # a key too
    (dict(json='{"enum": ["\\ud800"]}'), "json"),  # a JSON escape, found once parsed
    (dict(structural_tag={"triggers": ["<x"], "structures": [{"begin": "<x\ud800", "schema": {}, "end": ">"}]}),
     "structural_tag"),
])
def test_structured_outputs_name_the_field_that_is_not_valid_unicode(kw, field):
    """llguidance's own errors were codec text or a parse error."""
    from blockdraft import StructuredOutputsParams

    with pytest.raises(ValueError, match=rf"^structured_outputs.{field} is not valid Unicode text") as e:
        StructuredOutputsParams(**kw)
    assert e.value.param == field


def test_bad_words_that_are_not_valid_unicode_are_refused():
    with pytest.raises(ValueError, match=r"^bad_words entry '\\ud800' is not valid Unicode text") as e:
        SamplingParams(bad_words=["ok", "\ud800"])
    assert e.value.param == "bad_words"


def test_paths_safetensors_would_write_are_refused_when_not_utf8(tmp_path, monkeypatch, capsys):
    """safetensors takes UTF-8 paths only: a non-UTF-8 --cache-dir failed after converting the
    model, a non-UTF-8 --out after answering every prompt (a trial)."""
    from blockdraft.cli import main
    from blockdraft.weights.fetch import cache_root

    with pytest.raises(ValueError, match=r"^cache_dir '/tmp/c\\udce9' is not valid Unicode text: byte 0xE9") as e:
        cache_root("/tmp/c\udce9")
    assert e.value.param == "cache_dir"
    monkeypatch.setenv("BLOCKDRAFT_CACHE", "/tmp/d\udce9")
    with pytest.raises(ValueError, match=r"^\$BLOCKDRAFT_CACHE is not valid Unicode text"):
        cache_root()
    monkeypatch.delenv("BLOCKDRAFT_CACHE")
    out = str(tmp_path / "r\udce9")
    assert main(["train-drafter", "--target", "/nonexistent-model", "--tiny", "--out", out]) == 2
    assert "error: --out '" in capsys.readouterr().err
