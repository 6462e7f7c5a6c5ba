"""`blockdraft train-drafter` refuses bad flags, mismatched data and too-short prompt limits with
messages that name the flag (as the user spells it), the value and what to do."""

import pytest

import blockdraft.llm
from blockdraft.cli import main
from tests.training.test_train_drafter_e2e import NAME, _cached

pytestmark = [] if _cached() else [pytest.mark.slow]


@pytest.fixture
def no_weights(monkeypatch):
    """Fails the test if the target's weights load (every check here comes before them)."""
    monkeypatch.setattr(blockdraft.llm, "load_target", lambda *a, **k: pytest.fail("weights loaded before the check"))


def _error(capsys, *flags) -> str:
    assert main(["train-drafter", "--target", NAME, "--tiny", *flags]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1, got 0"),
    (["--num-anchors", "0"], "--num-anchors must be an integer >= 1, got 0"),
    (["--log-every", "0"], "--log-every must be an integer >= 1, got 0"),
    (["--lr", "0"], "--lr must be a finite number > 0, got 0.0"),
    (["--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["--block-size", "1"], "--block-size must be an integer >= 2, got 1"),
    (["--max-len", "1"], "--max-len must be an integer >= 2, got 1"),
    (["--ckpt-every", "-1"], "--ckpt-every must be an integer >= 0, got -1"),
    (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--mask-token-id", "49152"], "--mask-token-id must be in [0, 49152) (this target's vocabulary), got 49152"),
    (["--num-feature-layers", "30"], "--num-feature-layers must be at most 29 (distinct layers below the last of "
                                     "this target's 30), got 30"),
])
def test_bad_values_name_the_flag(flags, message, tmp_path, capsys, no_weights):
    err = _error(capsys, "--out", str(tmp_path), *flags)
    assert message in err
    assert "dflash_config" not in err and "batch_size" not in err
