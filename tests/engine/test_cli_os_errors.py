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
