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
