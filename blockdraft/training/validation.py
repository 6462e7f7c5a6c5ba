"""Held-out validation of drafters in training (Trainer.val_data, TrainConfig.val_every).

`check_val_settings` owns the rule for the held-out share and the cadence (--val-fraction,
--val-every) wherever they are given.

The same loss and per-slot top-1 accuracy as training (Trainer.loss_on), measured on sequences
held out of the training set (dataset.split_validation), on fixed batches (`val_batches`) and
fixed anchors (`val_anchor_generator`), without gradients: it changes neither the weights nor any
state training reads, so a run validates or not alike (`validate_together` restores torch's RNG
states and each drafter's train/eval mode).

Imports go one way: trainer.py imports this module, never the reverse; a trainer is used here
only through the `Validated` protocol.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from blockdraft.training.loss import StepStats

# + seed x 100,003 + batch: the generator of validation batch i's anchors (val_anchor_generator);
# training's are seed x 7,919 + step
VAL_ANCHOR_SEED = 2**41


class Validated(Protocol):
    """What validation reads of a trainer (training/trainer.py's Trainer): its drafter, device,
    step, cfg (seed, batch settings, greedy_labels), target, val_data, and the methods that prepare
    a validation batch and compute the loss on it."""

    drafter: torch.nn.Module
    device: torch.device
    step: int
    cfg: object
    target: object
    val_data: object

    def val_batches(self) -> list[list[int]]: ...

    def prepare_val(self, i: int, indices: list[int]) -> dict: ...

    def loss_on(self, prep: dict) -> tuple[torch.Tensor, dict]: ...


def check_val_settings(fraction, every=None, fraction_name: str = "--val-fraction",
                       every_name: str = "--val-every") -> None:
    """The one rule for the held-out share and the validation cadence, and its messages: train-drafter's
    and gpu_run's --val-fraction / --val-every, TrainConfig.val_fraction and dataset.split_validation
    call it, each naming the value as its user spells it (`fraction_name`, `every_name`).

    Args:
        fraction: the share of the sequences (answers) held out for validation: a number in [0, 1)
            (0: none held out, no validation).
        every: steps between validations as given (an integer >= 1), or None when not given (then
            neither its range nor the pairing is checked: a default cadence applies).
    Raises:
        ValueError: fraction not a number in [0, 1) (a bool or NaN included); every not an integer
            >= 1; every given with fraction 0 (validation with nothing held out: a forgotten
            --val-fraction). Each message names the value, the flag and what is allowed.
    """
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction < 1.0:
        raise ValueError(f"{fraction_name} must be a number in [0, 1) (the share of the answers held out for "
                         f"validation; 0: none), got {fraction!r}")
    if every is None:
        return
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{every_name} must be an integer >= 1 (steps between validations), got {every!r}")
    if not fraction:
        raise ValueError(f"{every_name} {every} validates on the answers {fraction_name} F holds out: it needs "
                         f"{fraction_name} F > 0 (got {fraction!r})")


def val_batches(val_data, batch_size: int) -> list[list[int]]:
    """Sequence indices of `val_data`'s (a TokenDataset) batches: sorted by length (less padding;
    ties by index) and cut into batches of `batch_size`, the last one partial. The same every time.

    Raises:
        ValueError: val_data is None.
    """
    if val_data is None:
        raise ValueError("this trainer has no val_data to validate on")
    lengths = val_data.lengths().tolist()
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[j : j + batch_size] for j in range(0, len(order), batch_size)]


def val_anchor_generator(seed: int, i: int) -> torch.Generator:
    """The CPU generator that draws validation batch `i`'s anchors: seeded by (seed, i) alone, not
    by the training step, so that every validation sees the same blocks and labels."""
    return torch.Generator().manual_seed(VAL_ANCHOR_SEED + seed * 100_003 + i)


def check_val_data(val_data, val_every: int, vocab_size: int, max_len: int) -> None:
    """The Trainer's val_data (a TokenDataset or None) against its settings.

    Raises:
        ValueError: val_every > 0 without val_data; val_data empty, with token ids outside
            [0, vocab_size) or without a response token to anchor within max_len tokens.
    """
    if val_data is None:
        if val_every:
            raise ValueError(f"val_every {val_every} validates on held-out sequences: give the Trainer "
                             f"val_data (dataset.split_validation), or val_every 0")
        return
    if len(val_data) == 0:
        raise ValueError("val_data holds no sequence: give None to train without validation")
    val_data.check_token_ids(vocab_size)
    if val_data.num_anchor_positions(max_len) == 0:
        raise ValueError(f"max_len (--max-len) {max_len} keeps no response token in any of the "
                         f"{len(val_data)} validation sequences (the shortest prompt has "
                         f"{val_data.shortest_prompt()} tokens): validation would measure nothing; raise "
                         f"--max-len or hold out more sequences")


def validate_together(trainers: list[Validated]) -> list[dict]:
    """Validate several drafters on the same batches (each batch's target features, anchors and
    labels prepared once, by trainers[0]): the loss and per-slot top-1 accuracy of `loss_on`, as
    training computes them, over every sequence of val_data (`val_batches`, fixed anchors:
    `prepare_val`).

    No gradients; each drafter is put in eval mode and back in the mode it was in; torch's global
    RNG states (CPU and the trainers' CUDA device) are restored after, so neither the weights nor
    anything the next training step reads change. Nothing is logged (fit_together logs).

    Returns one summary per trainer, as StepStats.summary: {"split": "val", "step", "loss" (mean
    of the per-batch losses), "acc" (per slot, pooled over all batches), "acc_mean", "tau_proxy",
    "sequences" (len(val_data)), "val_seconds" (wall time of this call)}.
    Raises:
        ValueError: a trainer without val_data, or trainers that would prepare other validation
            batches (another val_data, target, seed, batch settings, greedy_labels, block size,
            mask token, target_layer_ids or input embedding scale).
    """
    lead = trainers[0]
    if any(tr.val_data is None for tr in trainers):
        raise ValueError("validation needs val_data in every trainer")
    _check_same_batches(trainers)
    t0 = time.perf_counter()
    windows = [StepStats() for _ in trainers]
    modes = [tr.drafter.training for tr in trainers]
    cuda = [lead.device] if lead.device.type == "cuda" else []
    try:
        for tr in trainers:
            tr.drafter.eval()
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            for i, indices in enumerate(lead.val_batches()):
                prep = lead.prepare_val(i, indices)
                for window, tr in zip(windows, trainers):
                    loss, stats = tr.loss_on(prep)
                    window.add(float(loss), stats)
                del prep
    finally:
        for tr, mode in zip(trainers, modes):
            tr.drafter.train(mode)
    seconds = round(time.perf_counter() - t0, 2)
    return [{"split": "val", "step": tr.step, **w.summary(), "sequences": len(tr.val_data), "val_seconds": seconds}
            for w, tr in zip(windows, trainers)]


def _check_same_batches(trainers: list[Validated]) -> None:
    """Trainers validated together share trainers[0]'s prepared batches: what prepares them must match."""
    def key(t):
        c = t.drafter.config
        return (id(t.val_data), id(t.target), t.cfg.seed, t.cfg.batch_size, t.cfg.max_len, t.cfg.num_anchors,
                t.cfg.greedy_labels, c.block_size, c.mask_token_id, c.target_layer_ids, c.input_embedding_scale)

    if any(key(t) != key(trainers[0]) for t in trainers[1:]):
        raise ValueError("drafters validated together must share val_data, target, seed, batch settings, "
                         "greedy_labels, block size, mask token and target_layer_ids")
