"""A cache folder that is a file (or any other OS error on a path) is one line naming the path,
not a traceback."""

from __future__ import annotations

from blockdraft.cli import main


def test_cache_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    assert main(["generate", "hi", "--cache-dir", str(not_a_folder), "--max-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: Not a directory: ")
    assert str(not_a_folder) in err and "--cache-dir" in err


def test_an_os_file_not_found_is_one_line_naming_the_flags(monkeypatch, capsys):
    """FileNotFoundError from the OS (errno set) reads like the other OS errors, not like a check's
    message ("[Errno 2] ..."); e.g. a --cache-dir that cannot be created."""
    import blockdraft.llm

    def missing(*args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "/proc/no-such/cache")

    monkeypatch.setattr(blockdraft.llm.LLM, "__init__", missing)
    assert main(["generate", "hi", "--max-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert err == ("error: No such file or directory: /proc/no-such/cache (check the paths given: --cache-dir / "
                   "$BLOCKDRAFT_CACHE, --model, --draft, --out)\n")


def test_our_own_file_not_found_messages_still_name_the_flag(capsys):
    assert main(["generate", "hi", "--draft", "/nonexistent/drafter", "--max-tokens", "1"]) == 2
    assert capsys.readouterr().err.startswith("error: drafter folder '/nonexistent/drafter' does not exist")


def test_ctrl_c_is_one_line_and_the_sigint_status(monkeypatch, capsys):
    """Ctrl-C while a command runs: `blockdraft generate: interrupted` and exit 130 (128 + SIGINT, as
    shells report it), not a traceback."""
    import blockdraft.llm

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(blockdraft.llm.LLM, "__init__", interrupted)
    assert main(["generate", "hi", "--max-tokens", "1"]) == 130
    assert capsys.readouterr().err == "\nblockdraft generate: interrupted\n"


def test_draft_none_points_to_no_draft(capsys):
    """`--draft none` is a natural guess for "no drafter": the error says how to ask for that."""
    assert main(["generate", "hi", "--draft", "none", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: drafter folder 'none' does not exist") and "to decode without a drafter: --no-draft (Python: draft=None)" in err
