"""`blockdraft serve` refuses bad limits, a taken port and a host that does not resolve with one
line naming the flag, before the model loads (a minute on the CPU)."""

from __future__ import annotations

import pytest


def test_serve_limit_errors_name_the_flag_before_any_model_loads(capsys):
    from blockdraft.cli import main

    for flag, value in (("--max-logprobs", "-1"), ("--max-n", "0"), ("--port", "70000")):
        assert main(["serve", "--model", "/nonexistent-model", flag, value]) == 2
        err = capsys.readouterr().err
        assert f"({flag}) must be" in err and err.count("\n") == 1, err


def test_serve_refuses_a_taken_port_and_a_bad_host_before_loading_the_model(capsys):
    import socket

    from blockdraft.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", "/nonexistent-model", "--host", "127.0.0.1", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on --host '127.0.0.1' --port {port}" in err and "nonexistent" not in err, err
    assert main(["serve", "--model", "/nonexistent-model", "--host", "999.1.1.1"]) == 2
    err = capsys.readouterr().err
    assert "--host '999.1.1.1' does not resolve" in err, err


def test_serve_refuses_an_empty_api_key_instead_of_serving_without_one(capsys, monkeypatch):
    """`--api-key "$KEY"` with KEY unset passes an empty string: refused, not an open server.
    An empty $BLOCKDRAFT_API_KEY counts as unset."""
    from blockdraft.cli import main, _parser
    from blockdraft.server.launch import config_from_args

    for key in ("", "  "):
        assert main(["serve", "--model", "/nonexistent-model", "--api-key", key]) == 2
        err = capsys.readouterr().err
        assert "--api-key is empty" in err and "nonexistent" not in err and err.count("\n") == 1, err
    monkeypatch.setenv("BLOCKDRAFT_API_KEY", "")
    assert config_from_args(_parser().parse_args(["serve"])).api_key is None
    monkeypatch.setenv("BLOCKDRAFT_API_KEY", "s3cret")
    assert config_from_args(_parser().parse_args(["serve"])).api_key == "s3cret"


def test_serve_refuses_an_empty_served_model_name_instead_of_using_the_model(capsys):
    """`--served-model-name ''` (an unset shell variable?) was replaced by --model unnoticed."""
    from blockdraft.cli import main, _parser
    from blockdraft.server.launch import config_from_args

    for name in ("", "   "):
        assert main(["serve", "--model", "/nonexistent-model", "--served-model-name", name]) == 2
        err = capsys.readouterr().err
        assert (f"served_model_name (--served-model-name) must be a non-empty model id (the 'model' clients send), "
                f"got {name!r}") in err and "nonexistent" not in err and err.count("\n") == 1, err
    assert config_from_args(_parser().parse_args(["serve", "--model", "m"])).served_model_name == "m"
    assert config_from_args(_parser().parse_args(["serve", "--served-model-name", "x"])).served_model_name == "x"


def test_a_context_the_model_or_the_pool_cannot_hold_fails_at_start_naming_the_knob(tiny_model_dirs, capsys,
                                                                                     monkeypatch):
    """--max-model-len above the model's positions or the pool, and a --num-kv-blocks pool too small
    to serve (a 1-page pool started and then failed every chat request): one line naming the value,
    the limit and the flag, before any weights load."""
    import blockdraft.model_loader
    from blockdraft.cli import main

    monkeypatch.setattr(blockdraft.model_loader, "load_target", lambda *a, **k: pytest.fail("weights loaded"))
    model = str(tiny_model_dirs[0])  # max_position_embeddings 512
    serve = ["serve", "--model", model, "--no-draft", "--port", "0"]
    cases = [
        (serve + ["--max-model-len", "600"], "max_model_len (--max-model-len) 600 is above the model's context of 512 "
                                             "tokens (max_position_embeddings in its config.json): give at most 512"),
        (["generate", "hi", "--model", model, "--no-draft", "--max-model-len", "600"],
         "max_model_len (--max-model-len) 600 is above the model's context of 512 tokens"),
        (serve + ["--num-kv-blocks", "4", "--max-model-len", "100"],
         "max_model_len (--max-model-len) 100 does not fit the KV pool of 4 pages x 16 tokens = 64 tokens, and one "
         "request must fit it: raise num_kv_blocks (--num-kv-blocks) to at least 7, or lower max_model_len"),
        (serve + ["--num-kv-blocks", "1"], "--num-kv-blocks 1 x --kv-block-size 16 is a KV pool of 16 tokens, which "
                                           "would cap the context at 16 tokens (the model's is 512): too few to serve"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
    assert "Give --num-kv-blocks 16 or more (256 tokens), or --max-model-len 16 to serve" in err


def test_max_model_len_is_passed_to_the_engine(monkeypatch):
    """serve and generate hand --max-model-len to LLM (stopped there: no model is loaded)."""
    import blockdraft.llm
    from blockdraft.cli import main

    seen = []

    def fake_llm(**kw):
        seen.append(kw["max_model_len"])
        raise ValueError("stop here")

    monkeypatch.setattr(blockdraft.llm, "LLM", fake_llm)
    for argv in (["serve", "--no-draft", "--port", "0"], ["generate", "hi", "--no-draft"]):
        assert main([*argv, "--max-model-len", "300"]) == 2
        assert main(argv) == 2
    assert seen == [300, None, 300, None]


def test_serve_seed_is_the_engine_seed_default_0_and_generate_leaves_it_to_chance(monkeypatch, capsys):
    """serve --seed is vLLM's engine seed (default 0); generate's --seed seeds its one request, so
    its engine gets none (an unseeded generate samples afresh, as its help says)."""
    import blockdraft.llm
    from blockdraft.cli import main

    seen = []

    def fake_llm(**kw):
        seen.append(kw["seed"])
        raise ValueError("stop here")

    monkeypatch.setattr(blockdraft.llm, "LLM", fake_llm)
    for argv in (["serve"], ["serve", "--seed", "5"], ["generate", "hi", "--seed", "5"]):
        assert main([*argv, "--no-draft", "--port", "0"] if argv[0] == "serve" else [*argv, "--no-draft"]) == 2
    assert seen == [0, 5, None]


def test_serve_refuses_auto_tool_choice_without_a_parser(capsys):
    """vLLM's rule: --enable-auto-tool-choice needs --tool-call-parser; refused before the model loads."""
    from blockdraft.cli import _parser, main
    from blockdraft.server.launch import config_from_args

    assert main(["serve", "--model", "/nonexistent-model", "--enable-auto-tool-choice"]) == 2
    err = capsys.readouterr().err
    assert ("enable_auto_tool_choice (--enable-auto-tool-choice) needs tool_call_parser (--tool-call-parser hermes)"
            in err and "nonexistent" not in err), err
    config = config_from_args(_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]))
    assert config.enable_auto_tool_choice and config.tool_call_parser == "hermes"
