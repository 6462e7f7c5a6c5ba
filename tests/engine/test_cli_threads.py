"""`--threads` sets torch's CPU thread count before any model work; bad values are refused."""

from __future__ import annotations

import torch

from blockdraft.cli import main


def test_threads_flag_is_applied_and_checked(capsys):
    before = torch.get_num_threads()
    try:
        # an empty prompt fails right after the flags are applied: no model is loaded
        assert main(["generate", "", "--threads", "1"]) == 2
        assert torch.get_num_threads() == 1
        assert "prompt is empty" in capsys.readouterr().err
        assert main(["generate", "hi", "--threads", "0"]) == 2
        assert "--threads must be an integer >= 1, got 0" in capsys.readouterr().err
    finally:
        torch.set_num_threads(before)
