"""`blockdraft generate -` reads the prompt from standard input (`cat question.txt | ... generate -`)."""

from __future__ import annotations

import io

import pytest


class _Pipe(io.TextIOWrapper):
    def isatty(self) -> bool:
        return False


class _Terminal(_Pipe):
    def isatty(self) -> bool:
        return True


def _run(monkeypatch, capsys, stdin, *extra):
    from blockdraft.cli import main
    import blockdraft.engine_args

    seen = {}

    def fake_llm(args, draft, max_logprobs):
        seen["prompt"] = args.prompt
        raise SystemExit(0)  # the prompt is what this test is about

    monkeypatch.setattr(blockdraft.engine_args, "llm_from_args", fake_llm)
    monkeypatch.setattr("sys.stdin", stdin)
    try:
        code = main(["generate", "-", "--no-draft", *extra])
    except SystemExit as e:
        code = e.code
    return code, seen.get("prompt"), capsys.readouterr().err


def test_dash_reads_the_prompt_from_a_pipe(monkeypatch, capsys):
    text = "Line one.\nLine two — é 😀\n"
    code, prompt, _ = _run(monkeypatch, capsys, _Pipe(io.BytesIO(text.encode()), encoding="utf-8"))
    assert code == 0 and prompt == text[:-1]  # one trailing newline dropped


def test_dash_refuses_bytes_that_are_not_utf8_an_empty_pipe_and_a_terminal(monkeypatch, capsys):
    code, prompt, err = _run(monkeypatch, capsys, _Pipe(io.BytesIO(b"caf\xe9"), encoding="utf-8"))
    assert code == 2 and prompt is None and "the prompt is not valid Unicode text: byte 0xE9" in err
    code, prompt, err = _run(monkeypatch, capsys, _Pipe(io.BytesIO(b"\n"), encoding="utf-8"))
    assert code == 2 and "prompt is empty" in err
    code, prompt, err = _run(monkeypatch, capsys, _Terminal(io.BytesIO(b""), encoding="utf-8"))
    assert code == 2 and "reads the prompt from standard input, which is a terminal here: pipe it in" in err


@pytest.mark.parametrize("data, want", [(b"\xef\xbb\xbfHello\r\n", "Hello"), (b"a\n\n", "a\n"), (b"x\r", "x\r")])
def test_a_byte_order_mark_and_one_line_end_are_dropped(monkeypatch, capsys, data, want):
    code, prompt, _ = _run(monkeypatch, capsys, _Pipe(io.BytesIO(data), encoding="utf-8"))
    assert code == 0 and prompt == want


def test_closed_stdin_and_an_oversized_pipe_are_refused_by_what_they_are(monkeypatch, capsys):
    from blockdraft import cli

    code, _, err = _run(monkeypatch, capsys, None)
    assert code == 2 and "standard input, which is closed here" in err
    monkeypatch.setattr(cli, "STDIN_PROMPT_MAX_BYTES", 10)
    code, prompt, err = _run(monkeypatch, capsys, _Pipe(io.BytesIO(b"x" * 11), encoding="utf-8"))
    assert code == 2 and prompt is None and "the prompt on standard input is over 0 MiB" in err
    code, prompt, _ = _run(monkeypatch, capsys, _Pipe(io.BytesIO(b"x" * 10), encoding="utf-8"))
    assert code == 0 and prompt == "x" * 10
