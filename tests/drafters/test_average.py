"""`python -m blockdraft.drafters.average`: the weighted mean of drafters of one shape, as bf16
z-lab files or the shipped int8 pack; drafters of other shapes and bad weights are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from blockdraft.drafters.average import main, weighted_mean
from blockdraft.drafters.pack import PACK_FILE, pack, unpack
from blockdraft.spec.dflash.checkpoint import export_drafter, random_drafter
from tests.conftest import tiny_config


def _drafter(folder, seed: int, num_layers: int = 1):
    d = random_drafter(tiny_config(), num_layers=num_layers, block_size=4, target_layer_ids=(0, 2), seed=seed,
                       init_std=0.1)
    export_drafter(d, folder)
    (folder / "draft_vocab.json").write_text(json.dumps({"seed": seed}))  # sidecars come from the first
    return load_file(str(folder / "model.safetensors"))


def test_weighted_mean_in_bf16_and_as_the_int8_pack(tmp_path, capsys):
    a, b = _drafter(tmp_path / "a", 1), _drafter(tmp_path / "b", 2)
    assert main(["--draft", str(tmp_path / "a"), "--draft", str(tmp_path / "b"), "--weights", "0.25,0.75",
                 "--out", str(tmp_path / "mean")]) == 0
    mean = load_file(str(tmp_path / "mean" / "model.safetensors"))
    want = {k: (0.25 * a[k].float() + 0.75 * b[k].float()).to(torch.bfloat16) for k in a}
    assert set(mean) == set(a) and all(torch.equal(mean[k], want[k]) for k in a)
    assert not torch.equal(mean["fc.weight"], a["fc.weight"])
    assert json.loads((tmp_path / "mean" / "draft_vocab.json").read_text()) == {"seed": 1}
    assert (tmp_path / "mean" / "config.json").read_text() == (tmp_path / "a" / "config.json").read_text()

    # --pack writes what the shipped drafters store; an int8 pack is also read as an input
    assert main(["--draft", str(tmp_path / "a"), "--draft", str(tmp_path / "b"), "--weights", "0.25,0.75",
                 "--out", str(tmp_path / "packed"), "--pack"]) == 0
    packed = load_file(str(tmp_path / "packed" / PACK_FILE))
    assert all(torch.equal(packed[k], v) for k, v in pack(want).items())
    assert main(["--draft", str(tmp_path / "packed"), "--draft", str(tmp_path / "packed"),
                 "--out", str(tmp_path / "again")]) == 0
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert all(torch.equal(again[k], v) for k, v in unpack(packed).items())


@pytest.mark.parametrize("extra, message", [
    (["--weights", "0.5,0.6"], "--weights must be positive and sum to 1, got [0.5, 0.6]"),
    (["--weights", "1"], "--weights has 1 value(s) for 2 drafters"),
    (["--weights", "1.5,-0.5"], "--weights must be positive and sum to 1"),
])
def test_bad_weights_are_refused(tmp_path, capsys, extra, message):
    _drafter(tmp_path / "a", 1), _drafter(tmp_path / "b", 2)
    assert main(["--draft", str(tmp_path / "a"), "--draft", str(tmp_path / "b"), "--out", str(tmp_path / "m"),
                 *extra]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_other_shapes_one_drafter_and_a_used_out_folder_are_refused(tmp_path, capsys):
    _drafter(tmp_path / "a", 1), _drafter(tmp_path / "deep", 2, num_layers=2)
    assert main(["--draft", str(tmp_path / "a"), "--draft", str(tmp_path / "deep"), "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "drafters of different shapes cannot be averaged: num_hidden_layers is 1 in" in err
    assert main(["--draft", str(tmp_path / "a"), "--out", str(tmp_path / "m")]) == 2
    assert "averaging needs at least two drafters" in capsys.readouterr().err
    assert main(["--draft", str(tmp_path / "a"), "--draft", str(tmp_path / "a"), "--out", str(tmp_path / "a")]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err


def test_weighted_mean_names_a_missing_or_misshapen_tensor():
    a = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    assert torch.equal(weighted_mean([a, {"w": torch.full((2, 3), 3.0), "b": torch.ones(3)}], [0.5, 0.5])["w"],
                       torch.full((2, 3), 2.0))
    with pytest.raises(ValueError, match="tensor 'b' is in only one of 'trained' and 'init'"):
        weighted_mean([a, {"w": torch.ones(2, 3)}], [0.5, 0.5], ["trained", "init"])
    with pytest.raises(ValueError, match=r"tensor 'w' has shape \(3, 2\) in 'state 1', \(2, 3\) in 'state 0'"):
        weighted_mean([a, {"w": torch.ones(3, 2), "b": torch.zeros(3)}], [0.5, 0.5])
