"""`blockdraft serve` refuses bad limits, a taken port and a host that does not resolve with one
line naming the flag, before the model loads (a minute on the CPU)."""

from __future__ import annotations


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
