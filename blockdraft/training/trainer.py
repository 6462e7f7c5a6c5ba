"""Train a DFlash drafter against a frozen target (DFLASH.md "Training").

One step: target features of a padded batch (no grad; or read from a FeatureCache computed once,
training/features.py) -> random anchors among response tokens -> dense forward of every block at
once (training/dense.py) -> target LM head on slots 1..B-1 (or only its draft-vocabulary rows) ->
decay-weighted CE (training/loss.py). AdamW with linear warmup + cosine decay, gradient clipping,
bf16 autocast on CUDA (fp32 master weights), fp32 on CPU.

Determinism: batch order is a pure function of (seed, epoch) and anchors of (seed, step), so a
resumed run replays exactly the batches and anchors of an uninterrupted one.
Validation (optional: Trainer.val_data, TrainConfig.val_every; training/validation.py): the same
loss and per-slot accuracy on held-out sequences (dataset.split_validation), on fixed batches and
anchors, without gradients; it changes neither the weights nor any state training reads, so a run
validates or not alike.
Checkpoints (`<out>/checkpoint/`): drafter.safetensors (fp32 master weights, z-lab names),
optimizer.safetensors (AdamW moments by parameter name), state.json (step, config, target dtype,
metrics, the other files' sizes; written last). The set is replaced as one (written into
`<out>/checkpoint.new/`, then swapped in: training/atomic_folder.py), so an interruption mid-save
leaves the previous checkpoint or the new one, never a mix.
No pickles are written or read. The result is exported in the z-lab format (export_drafter).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from blockdraft.spec.dflash.draft_model import DFlashDraftModel
from blockdraft.training import validation
from blockdraft.training.atomic_folder import current_folder, replace_folder, settle_folder, write_synced
from blockdraft.training.dataset import TokenDataset, collate, epoch_batches
from blockdraft.training.dense import dense_block_forward
from blockdraft.training.features import FeatureCache
from blockdraft.training.loss import StepStats, block_labels, default_gamma, slot_weights, weighted_block_loss
from blockdraft.training.masks import sample_anchors
from blockdraft.training.target import TrainTarget


@dataclass
class TrainConfig:
    """Optimisation settings (drafter shape lives in the DFlashConfig).

    steps: optimizer steps. batch_size: sequences per step; max_len: tokens kept per sequence.
    num_anchors: blocks per sequence (paper: 512 on long sequences). lr: peak AdamW lr;
    warmup_frac: linear warmup share of the steps (> 0: at least one step below the peak, see
    warmup_length); warmup_steps: the warmup's length in steps instead (None: from warmup_frac;
    fit_together's re-plan fixes it, so that a longer schedule does not restart the warmup).
    min_lr_ratio: cosine floor (x lr).
    gamma: loss decay (None: default_gamma(B)). grad_clip: max global grad norm (0 = off).
    pad_multiple: batch width rounded up to a multiple of this (dataset.collate; the same loss,
    few distinct shapes: on an H200 a 16-sequence step ran 140-170 ms on new shapes, 22 ms warm).
    ckpt_every: steps between checkpoints (0 = only at the end). log_every: steps per log line.
    greedy_labels: label each block slot with the target's greedy continuation from the block's
    anchor: the argmax next token after the answer's tokens (`TrainTarget.features_and_greedy`),
    kept only while the answer's tokens before it in the block are the greedy ones
    (`on_greedy_chain`). The same labels for answers decoded greedily; for sampled ones, what
    verification accepts (a draft is accepted when it equals the target's greedy token at T = 0,
    and the most likely token is the draft exact-match sampling at T > 0 accepts most often).
    val_every: steps between validations on the Trainer's val_data (0 = off); when on, fit /
    fit_together also validate before the first step of a fresh run (the starting weights) and
    after the last. Like ckpt_every / log_every, it may change on resume.
    val_fraction: the share of the dataset held out as val_data (dataset.split_validation). The
    Trainer does not split (it is given data and val_data): the value is recorded in the checkpoint
    so that resuming with another split, i.e. another training set, is refused.
    """

    steps: int = 1000
    batch_size: int = 16
    max_len: int = 1024
    num_anchors: int = 64
    lr: float = 6e-4
    warmup_frac: float = 0.04
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    gamma: float | None = None
    seed: int = 0
    ckpt_every: int = 0
    log_every: int = 10
    pad_multiple: int = 64
    greedy_labels: bool = False
    val_every: int = 0
    val_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("batch_size", 1), ("max_len", 2), ("num_anchors", 1), ("ckpt_every", 0),
                          ("log_every", 1), ("seed", 0), ("pad_multiple", 1), ("val_every", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.greedy_labels, bool):
            raise ValueError(f"greedy_labels must be True or False, got {self.greedy_labels!r}")
        if self.warmup_steps is not None and (isinstance(self.warmup_steps, bool)
                                              or not isinstance(self.warmup_steps, int) or self.warmup_steps < 1):
            raise ValueError(f"warmup_steps must be None or an integer >= 1, got {self.warmup_steps!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        for name in ("warmup_frac", "min_lr_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        # val_every 0 is "off" here (the flag's None): only a cadence that is on needs a held-out share
        validation.check_val_settings(self.val_fraction, self.val_every or None, fraction_name="val_fraction",
                                      every_name="val_every")
        if not self.weight_decay >= 0 or not self.grad_clip >= 0:
            raise ValueError(f"weight_decay and grad_clip must be >= 0, got {self.weight_decay!r}, {self.grad_clip!r}")


def greedy_label_ids(input_ids: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Token ids whose position p >= 1 holds the target's greedy choice there, greedy[:, p - 1]
    (input_ids, greedy: [b, T] int64); position 0 keeps its token (never a label). What
    `block_labels` reads for TrainConfig.greedy_labels."""
    out = input_ids.clone()
    out[:, 1:] = greedy[:, :-1]
    return out


def on_greedy_chain(input_ids: torch.Tensor, label_ids: torch.Tensor, anchors: torch.Tensor,
                    block_size: int) -> torch.Tensor:
    """[b, A, B-1] bool: slot k of the block at each anchor a sits on the target's greedy chain from
    a, i.e. the answer's tokens at a+1 .. a+k-1 are the greedy ones (input_ids == label_ids there;
    input_ids, label_ids [b, T] int64 from `greedy_label_ids`; anchors [b, A]). The drafter drafts
    all slots from the context up to a, and verification reaches slot k only through drafts equal
    to the greedy tokens before it: past a sampled token that left the chain, the argmax after the
    answer's tokens is not a label of that chain. Positions past T read the last column (their
    slots are dropped by block_labels' length mask anyway)."""
    t = input_ids.shape[1]
    pos = (anchors[:, :, None] + torch.arange(1, block_size, device=anchors.device)).clamp(max=t - 1)
    flat = pos.reshape(pos.shape[0], -1)
    greedy_here = (input_ids.gather(1, flat) == label_ids.gather(1, flat)).view_as(pos)
    ok = torch.ones_like(greedy_here)
    ok[..., 1:] = greedy_here[..., :-1].long().cumprod(-1).bool()  # every earlier slot's token greedy
    return ok


def warmup_length(cfg: TrainConfig) -> int:
    """Warmup length W of `cfg`'s schedule in steps: cfg.warmup_steps, else round(warmup_frac x
    steps), at least 1, and at least 2 when warmup_frac > 0 and steps > 1.

    lr_at ramps step s < W to lr x (s + 1) / W, so W counts the steps up to the first one at the
    peak: W = 1 is no warmup (step 0 at the peak, right for warmup_frac 0). A short run rounded a
    warmup share to W = 1 (4 steps x 0.04 = 0.16) and took its first step at the peak lr: continuing
    a shipped drafter that way lost acceptance. So a warmup share > 0 always buys at least one step
    below the peak (step 0 at lr / 2). An explicit warmup_steps is taken as given.
    """
    if cfg.warmup_steps is not None:
        return cfg.warmup_steps
    least = 2 if cfg.warmup_frac > 0 and cfg.steps > 1 else 1
    return max(least, round(cfg.warmup_frac * cfg.steps))


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then cosine to min_lr_ratio."""
    warmup = warmup_length(cfg)
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, cfg.steps - warmup))
    floor = cfg.min_lr_ratio
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class Trainer:
    """Owns the drafter being trained, its optimizer, and the loop.

    Args:
        drafter: a DFlashDraftModel in float32 on `device` (trainable params).
        target: a TrainTarget (training/target.py) on the same device; frozen.
        data: the TokenDataset. cfg: TrainConfig. out_dir: checkpoints + logs go here.
        features: a FeatureCache of `data` for this drafter's target_layer_ids and cfg.max_len
            (training/features.py), or None to run the target every step. Same values either way.
        draft_vocab: [N] int64 target ids of the draft vocabulary the drafter will decode with
            (blockdraft.spec.draft_vocab), or None for the full vocabulary. The loss is then the CE
            over those N LM-head rows, the objective the drafter is used with (FR-Spec, arXiv
            2502.14856), at N/V of the LM-head cost; labels outside it are left out of the loss
            and counted as misses in the per-slot accuracy.
    Raises:
        ValueError: token ids of `data` outside [0, target vocab) (data made for another target);
            draft_vocab not 1-D, with repeated ids or ids outside [0, target vocab); no
            response token left to anchor a block once sequences are cut to cfg.max_len (every
            prompt that long: training would only log a loss of 0); a `features` cache built for
            other layer ids, another max_len or another dataset size.
        target_dtype: the target's dtype ("float32" | "bfloat16"), recorded in the checkpoint's
            state.json (train-drafter refuses to resume a run in another; None: not recorded).
        target_name / target_path: the target as the run named it (train-drafter's --target) and
            its folder, recorded in state.json as "target" / "target_path" (train-drafter refuses
            to resume a run for another target by that name first; None: not recorded).
        val_data: held-out sequences (dataset.split_validation) for `validate`, or None. Validation
            never reads `features` (its row indices are those of `data`): it runs the target on
            each validation batch, ceil(len(val_data) / cfg.batch_size) target + drafter forwards
            per validation, no backward and no memory beyond a step's (split_validation caps the
            set at MAX_VAL_SEQUENCES sequences, so the cost stays bounded whatever the data size).
    Raises (also):
        ValueError: cfg.val_every > 0 without val_data; val_data empty, with token ids outside the
            target's vocabulary or without a response token to anchor within cfg.max_len.
    """

    drafter: DFlashDraftModel
    target: TrainTarget
    data: TokenDataset
    cfg: TrainConfig
    out_dir: Path
    step: int = 0
    history: list = field(default_factory=list)
    features: FeatureCache | None = None
    draft_vocab: torch.Tensor | None = None
    target_dtype: str | None = None
    val_data: TokenDataset | None = None
    val_history: list = field(default_factory=list)
    target_name: str | None = None
    target_path: str | None = None

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        self.device = self.drafter.device
        self.drafter.requires_grad_(True).train()
        decay = [p for n, p in self.drafter.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.drafter.named_parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=self.cfg.lr, betas=self.cfg.betas)
        dcfg = self.drafter.config
        self.block_size = dcfg.block_size
        self.weights = slot_weights(self.block_size, self.cfg.gamma or default_gamma(self.block_size), self.device)
        self.data.check_token_ids(self.target.vocab_size)
        if self.data.num_anchor_positions(self.cfg.max_len) == 0:
            raise ValueError(
                f"max_len (--max-len) {self.cfg.max_len} keeps no response token to train on in any of the "
                f"{len(self.data)} training sequences (the shortest prompt has {self.data.shortest_prompt()} tokens; "
                f"a block needs a response token and one more token within max_len): raise --max-len or lower "
                f"--max-prompt-tokens")
        self._lengths = self.data.lengths()
        self._epoch_cache: tuple[int, list] | None = None
        # seconds(): training seconds before the current fit (a resumed checkpoint's), the current one's start
        self._seconds_before, self._fit_started = 0.0, None
        self._draft = None if self.draft_vocab is None else self._draft_rows(self.draft_vocab)
        if self.features is not None:
            self._check_features(self.features)
        validation.check_val_data(self.val_data, self.cfg.val_every, self.target.vocab_size, self.cfg.max_len)

    def _check_features(self, cache: FeatureCache) -> None:
        want = (tuple(self.drafter.config.target_layer_ids), self.cfg.max_len, len(self.data))
        got = (cache.layer_ids, cache.max_len, len(cache))
        if got != want:
            raise ValueError(f"the feature cache holds layers {got[0]}, max_len {got[1]}, {got[2]} sequences; this "
                             f"trainer needs layers {want[0]}, max_len {want[1]}, {want[2]} sequences: build it "
                             f"for this drafter, config and dataset")
        if self.cfg.greedy_labels and cache.greedy is None:
            raise ValueError("greedy_labels needs the target's greedy tokens in the feature cache: build it with "
                             "FeatureCache.build(..., greedy=True)")

    def _draft_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(LM-head rows [N, H], label map [V] int64: target id -> draft column, -1 outside)."""
        vocab = self.target.vocab_size
        ids = torch.as_tensor(ids).long()
        if ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"draft_vocab must be a non-empty 1-D tensor of ids in [0, {vocab}), got shape "
                             f"{list(ids.shape)}" + (f", ids {int(ids.min())}..{int(ids.max())}" if ids.numel() else ""))
        if ids.unique().numel() != ids.numel():
            raise ValueError(f"draft_vocab repeats ids ({ids.numel() - ids.unique().numel()} duplicates)")
        ids = ids.to(self.device)
        label_map = torch.full((vocab,), -1, dtype=torch.long, device=self.device)
        label_map[ids] = torch.arange(ids.numel(), device=self.device)
        return self.target.lm_head_rows(ids).to(self.device), label_map

    # ---- data ----------------------------------------------------------------------------------

    def batch_indices(self, step: int) -> list[int]:
        """Sequence indices of optimizer step `step` (deterministic; epochs reshuffle)."""
        n_batches = math.ceil(len(self.data) / self.cfg.batch_size)
        epoch, i = divmod(step, n_batches)
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            self._epoch_cache = (epoch, epoch_batches(self._lengths, self.cfg.batch_size, self.cfg.seed, epoch))
        return self._epoch_cache[1][i]

    def _autocast(self):
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ---- one step ------------------------------------------------------------------------------

    def prepare(self, step: int) -> dict:
        """Everything of step `step` that does not depend on the drafter's weights: the batch,
        target features, anchors, block embeddings and labels (shareable between drafters with
        the same target_layer_ids, block size, mask token and seed: see `fit_together`)."""
        gen = torch.Generator().manual_seed(self.cfg.seed * 7_919 + step)
        return self._prepare(self.data, self.batch_indices(step), self.features, gen)

    def _prepare(self, data: TokenDataset, indices: list[int], features: FeatureCache | None,
                 gen: torch.Generator) -> dict:
        """`prepare` of sequences `indices` of `data` (features from `features`, a cache of `data`,
        or from the target when None), anchors drawn with `gen`."""
        dcfg = self.drafter.config
        batch = collate(data, indices, self.cfg.max_len, self.cfg.pad_multiple).to(self.device)
        greedy = None
        if features is not None:
            feats = features.batch(indices, batch.input_ids.shape[1])
            if self.cfg.greedy_labels:
                greedy = features.greedy_batch(indices, batch.input_ids.shape[1]).to(self.device)
        elif self.cfg.greedy_labels:
            feats, greedy = self.target.features_and_greedy(batch.input_ids, batch.lengths, dcfg.target_layer_ids)
        else:
            feats = self.target.features(batch.input_ids, batch.lengths, dcfg.target_layer_ids)
        anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, self.cfg.num_anchors, gen)
        b, a, bs = anchors.shape[0], anchors.shape[1], self.block_size
        block_ids = torch.full((b, a, bs), dcfg.mask_token_id, dtype=torch.long, device=self.device)
        block_ids[:, :, 0] = batch.input_ids.gather(1, anchors)
        embeds = self.target.embed(block_ids.view(b, a * bs))
        if dcfg.input_embedding_scale != 1.0:
            embeds = embeds * dcfg.input_embedding_scale
        label_ids = batch.input_ids if greedy is None else greedy_label_ids(batch.input_ids, greedy)
        labels, keep = block_labels(label_ids, batch.loss_mask, batch.lengths, anchors, valid, bs)
        if greedy is not None:  # a slot counts only on the greedy chain from its anchor
            keep &= on_greedy_chain(batch.input_ids, label_ids, anchors, bs)
            labels = torch.where(keep, labels, torch.zeros_like(labels))
        return {"feats": feats, "anchors": anchors, "valid": valid, "embeds": embeds, "labels": labels, "keep": keep}

    def loss_on(self, prep: dict) -> tuple[torch.Tensor, dict]:
        """Decay-weighted loss and per-slot stats of this drafter on a prepared step."""
        anchors, keep, bs = prep["anchors"], prep["keep"], self.block_size
        b, a = anchors.shape
        with self._autocast():
            hidden = dense_block_forward(self.drafter, prep["feats"], prep["embeds"], anchors, prep["valid"])
            rows = hidden.view(b, a, bs, -1)[:, :, 1:][keep]  # [N, H] kept slots 1..B-1
            slots = torch.arange(bs - 1, device=self.device).expand_as(keep)[keep]
            labels = prep["labels"][keep]
            if self._draft is None:
                return weighted_block_loss(self.drafter.compute_logits(rows, self.target.lm_head), labels, slots,
                                           self.weights)
            head, label_map = self._draft
            local = label_map[labels]
            inside = local >= 0
            logits = self.drafter.compute_logits(rows[inside], lambda h: F.linear(h.to(head.dtype), head))
            loss, stats = weighted_block_loss(logits, local[inside], slots[inside], self.weights)
            # labels outside the draft vocabulary can never be drafted: count them as misses
            stats["count"].index_add_(0, slots[~inside], torch.ones_like(slots[~inside], dtype=stats["count"].dtype))
            return loss, stats

    def train_step(self, prep: dict | None = None) -> tuple[float, dict]:
        """One optimizer step (on `prep` if given, else on this step's own batch); returns (loss, stats)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, self.cfg)
        loss, stats = self.loss_on(prep if prep is not None else self.prepare(self.step))
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        return float(loss.detach()), stats

    # ---- validation (training/validation.py) ---------------------------------------------------

    def val_batches(self) -> list[list[int]]:
        """Sequence indices of val_data's batches of cfg.batch_size (validation.val_batches: the same
        every time). Raises ValueError without val_data."""
        return validation.val_batches(self.val_data, self.cfg.batch_size)

    def prepare_val(self, i: int, indices: list[int]) -> dict:
        """`prepare` of validation batch `i` (sequences `indices` of val_data, from val_batches):
        features from the target (never from the training cache, whose rows are `data`'s), anchors
        from validation.val_anchor_generator(cfg.seed, i), so that every validation sees the same
        blocks and labels."""
        return self._prepare(self.val_data, indices, None, validation.val_anchor_generator(self.cfg.seed, i))

    def validate(self) -> dict:
        """Loss and per-slot top-1 accuracy of the drafter on all of val_data
        (validation.validate_together with this trainer alone): {"split": "val", "step", "loss",
        "acc", "acc_mean", "tau_proxy", "sequences", "val_seconds"}; the same values as long as the
        weights are the same."""
        return validation.validate_together([self])[0]

    def _log_val(self, summary: dict, seconds: float) -> dict:
        """Record a validation summary (val_history, and a line of train_log.jsonl marked
        "split": "val"; `seconds`: Trainer.seconds(), as the training lines')."""
        s = {**summary, "seconds": round(seconds, 1)}
        self.val_history.append(s)
        self._append_log(s)
        return s

    # ---- loop ----------------------------------------------------------------------------------

    def fit(self, progress: bool = True, deadline: float | None = None, until: int | None = None,
            should_stop: Callable[[], bool] | None = None) -> dict:
        """Train until cfg.steps (or step `until`, or the wall-clock `deadline`, time.time()
        seconds, or `should_stop()` after a step), checkpointing every cfg.ckpt_every steps and at
        the end, validating every cfg.val_every steps (see fit_together). Returns the last logged
        training summary (the validations: val_history)."""
        return fit_together([self], progress, deadline, until, should_stop=should_stop)[0]

    def seconds(self) -> float:
        """Seconds this run has trained (float, wall time on trainer._clock): the time of its fits
        since step 0, those before a resume included (state.json's "seconds"), not the time between
        an interruption and the resume. What train_log.jsonl's "seconds" holds, so that a resumed
        run's log goes on monotonically where the checkpoint left it."""
        running = 0.0 if self._fit_started is None else _clock() - self._fit_started
        return self._seconds_before + running

    def _run_clock(self, running: bool) -> None:
        """Start (a fit begins) or stop (it ended) counting time into `seconds`."""
        self._seconds_before, self._fit_started = self.seconds(), (_clock() if running else None)

    def _log(self, window: "StepStats", seconds: float) -> dict:
        s = window.summary()
        s.update(step=self.step, lr=lr_at(max(0, self.step - 1), self.cfg), seconds=round(seconds, 1))
        self.history.append(s)
        self._append_log(s)
        return s

    def _append_log(self, line: dict) -> None:
        """One line of `<out>/train_log.jsonl` (training and validation lines alike)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / "train_log.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    # ---- checkpoints ---------------------------------------------------------------------------

    @property
    def ckpt_dir(self) -> Path:
        """`<out>/checkpoint`: where the checkpoint is (save_checkpoint writes beside it first)."""
        return self.out_dir / "checkpoint"

    def save_checkpoint(self) -> Path:
        """Write drafter + AdamW state (safetensors) and state.json (last, with the other files'
        sizes in "files") as one set: into `<out>/checkpoint.new/`, fsynced, then swapped in for
        `<out>/checkpoint/` (atomic_folder.replace_folder). An interruption anywhere leaves either
        the previous checkpoint or this one whole. Returns `<out>/checkpoint`."""
        from blockdraft.weights.save import save_safetensors

        weights = {k: v.detach().float().cpu().contiguous() for k, v in self.drafter.state_dict().items()}

        def fill(d: Path) -> None:
            files = {"drafter.safetensors": write_synced(d / "drafter.safetensors",
                                                         lambda p: save_safetensors(weights, str(p))),
                     "optimizer.safetensors": write_synced(d / "optimizer.safetensors",
                                                           lambda p: save_safetensors(self._optimizer_tensors(), str(p)))}
            state = {"step": self.step, "train_config": asdict(self.cfg), "train_vocab_size": self._train_vocab_size(),
                     "drafter_config": self.drafter.config.to_hf_dict(), "target_dtype": self.target_dtype,
                     "seconds": self.seconds(), "history": self.history, "val_history": self.val_history,
                     "files": files}
            if self.target_name is not None:
                state.update(target=self.target_name, target_path=self.target_path)
            write_synced(d / STATE_FILE, lambda p: p.write_text(json.dumps(state, indent=1)))

        self.out_dir.mkdir(parents=True, exist_ok=True)
        return replace_folder(self.ckpt_dir, fill, STATE_FILE)

    def _train_vocab_size(self) -> int:
        """Columns of the loss's LM head: the draft vocabulary's size, 0 for the full vocabulary."""
        return 0 if self._draft is None else int(self._draft[0].shape[0])

    def _optimizer_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for name, p in self.drafter.named_parameters():
            st = self.optimizer.state.get(p)
            if st:
                out[f"{name}.exp_avg"] = st["exp_avg"].detach().cpu().contiguous()
                out[f"{name}.exp_avg_sq"] = st["exp_avg_sq"].detach().cpu().contiguous()
                out[f"{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1).cpu()
        return out

    def load_checkpoint(self) -> bool:
        """Resume from `<out>/checkpoint/` if present: weights, AdamW moments, step, history,
        val_history and the seconds trained so far (`seconds`: the log's seconds run on).

        A save an interruption cut short is settled first (atomic_folder.settle_folder): the
        complete checkpoint it left, the previous or the new one, becomes `<out>/checkpoint/`.

        Returns False when there is no checkpoint. Raises ValueError when the checkpoint's drafter
        config differs from this drafter's (resuming into a different shape), or when a setting
        that decides the batches, anchors, schedule or loss differs (every TrainConfig field but
        ckpt_every / log_every / val_every, and the draft vocabulary's size; val_fraction counts: it
        decides the training set): the resumed run would not be
        the run the checkpoint belongs to. The message names each differing setting. Also when a
        file's size is not the one state.json recorded (a copy cut short; checkpoints written
        before the sizes were recorded are not checked), naming the folder and the file.
        """
        from safetensors.torch import load_file

        d = self.ckpt_dir
        state = read_checkpoint_state(self.out_dir)
        if state is None:
            return False
        settle_folder(d, STATE_FILE)
        check_checkpoint_files(d, state)
        shape = drafter_config_differences(state["drafter_config"], self.drafter.config.to_hf_dict())
        if shape:
            differ = ", ".join(f"{k}={v!r} (now {now!r})" for k, v, now in shape)
            raise ValueError(f"checkpoint in {d} is for another drafter shape: {differ}; resume with the same "
                             f"shape, or start over (train-drafter --no-resume) or in another --out")
        differ = checkpoint_differences(state, self.cfg, self._train_vocab_size())
        if differ:
            raise ValueError(f"checkpoint in {d} was trained with {', '.join(differ)}: resume with the same settings, "
                             f"or start over (train-drafter --no-resume) or in another --out")
        weights = load_file(str(d / "drafter.safetensors"))
        with torch.no_grad():
            for k, v in self.drafter.state_dict().items():
                v.copy_(weights[k])
        moments = load_file(str(d / "optimizer.safetensors"))
        for name, p in self.drafter.named_parameters():
            if f"{name}.exp_avg" in moments:
                self.optimizer.state[p] = {
                    "step": moments[f"{name}.step"].reshape(()).clone(),
                    "exp_avg": moments[f"{name}.exp_avg"].to(p.device),
                    "exp_avg_sq": moments[f"{name}.exp_avg_sq"].to(p.device),
                }
        self.step, self.history = int(state["step"]), list(state.get("history", []))
        self.val_history = list(state.get("val_history", []))
        # a checkpoint from before "seconds" was recorded: its last logged line's, the nearest it knows
        logged = [line.get("seconds", 0.0) for line in self.history + self.val_history]
        self._seconds_before, self._fit_started = float(state.get("seconds", max(logged, default=0.0))), None
        self._drop_log_lines_after(self.step)
        return True

    def _drop_log_lines_after(self, step: int) -> None:
        """Remove from train_log.jsonl the lines of steps past `step`, the checkpoint a resumed run
        starts from (an interrupted run logged them, the resumed one redoes and logs them again;
        validation lines too), and a line cut short by the interruption."""
        log = self.out_dir / "train_log.jsonl"
        if not log.is_file():
            return
        lines = log.read_text().splitlines(keepends=True)
        kept = []
        for line in lines:
            try:
                if json.loads(line).get("step", 0) <= step and line.endswith("\n"):
                    kept.append(line)
            except ValueError:
                continue
        if len(kept) != len(lines):
            _atomic(log, lambda p: p.write_text("".join(kept)))


STATE_FILE = "state.json"  # a checkpoint's last file: its presence marks the folder complete


def read_checkpoint_state(out_dir: str | Path) -> dict | None:
    """`<out_dir>/checkpoint/state.json` (step, train_config, drafter_config, target_dtype, files,
    ...), None without one. Reads only: after an interrupted save, the complete checkpoint it left
    (`<out_dir>/checkpoint.new/` or `.old/`: atomic_folder.current_folder), which
    Trainer.load_checkpoint then renames into place.

    Raises:
        ValueError: the file is not a JSON object (names the file and how to go on).
    """
    folder = current_folder(Path(out_dir) / "checkpoint", STATE_FILE)
    if folder is None:
        return None
    file = folder / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except ValueError as e:
        state = e
    if not isinstance(state, dict) or not {"step", "drafter_config"} <= state.keys():
        why = f"not valid JSON ({state})" if isinstance(state, ValueError) else "not a checkpoint's state"
        raise ValueError(f"{file} is {why}: the checkpoint is damaged; start over with --no-resume or use "
                         f"another --out")
    return state


def check_checkpoint_files(folder: Path, state: dict) -> None:
    """Each file state["files"] records ({name: size in bytes}) is in `folder` with that size.
    A state without "files" (a checkpoint written before they were recorded) is not checked.

    Raises:
        ValueError: a file missing or of another size (names the folder, the file, both sizes and
            how to go on).
    """
    for name, size in (state.get("files") or {}).items():
        file = Path(folder) / name
        have = file.stat().st_size if file.is_file() else None
        if have != size:
            found = "is missing" if have is None else f"has {have} bytes"
            raise ValueError(f"checkpoint in {folder} is damaged: {name} {found}, its state.json recorded {size} "
                             f"bytes (a copy cut short?); start over with --no-resume or use another --out")


def drafter_config_differences(saved: dict, asked: dict) -> list[tuple[str, object, object]]:
    """(key, saved, asked) of each drafter config entry (`DFlashConfig.to_hf_dict()`, the nested
    "dflash_config" entries by their own names) that differs between a checkpoint and this run."""
    def flat(d: dict) -> dict:
        out = {k: v for k, v in d.items() if k != "dflash_config"}
        out.update(d.get("dflash_config") or {})
        return out

    a, b = flat(saved), flat(asked)
    return [(k, a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if _as_json(a.get(k)) != _as_json(b.get(k))]


def checkpoint_difference_items(state: dict, cfg: TrainConfig, train_vocab_size: int) -> list[tuple[str, object, object]]:
    """(name, saved, asked) of each setting a checkpoint's `state` was trained with that differs from
    `cfg` / `train_vocab_size`; every TrainConfig field counts but RESUMABLE_CHANGES (they change
    neither the batches, anchors, schedule nor loss)."""
    # fields added after checkpoints were first written: absent means the behaviour before them
    saved = {"warmup_steps": None, "greedy_labels": False, "val_fraction": 0.0, **state.get("train_config", {}),
             "train_vocab_size": state.get("train_vocab_size", 0)}
    asked = {**asdict(cfg), "train_vocab_size": train_vocab_size}
    return [(k, saved[k], asked[k]) for k in asked
            if k not in RESUMABLE_CHANGES and k in saved and _as_json(saved[k]) != _as_json(asked[k])]


# TrainConfig fields a resumed run may change: how often it checkpoints, logs and validates
RESUMABLE_CHANGES = ("ckpt_every", "log_every", "val_every")


def checkpoint_differences(state: dict, cfg: TrainConfig, train_vocab_size: int) -> list[str]:
    """`checkpoint_difference_items` as "name=saved (now asked)"."""
    return [f"{k}={s!r} (now {a!r})" for k, s, a in checkpoint_difference_items(state, cfg, train_vocab_size)]


# fit_together's re-plan under a time budget: the pace is measured from REPLAN_WARM_STEPS steps in
# (new batch shapes and the CUDA allocator's growth slow the first ones), over REPLAN_FIRST steps
# first, then again at half way of the new plan.
REPLAN_WARM_STEPS = 20
REPLAN_FIRST = 100
_clock = time.perf_counter  # seconds; the re-plan's and the logs' clock (tests step it by hand)


def replan_steps(step: int, elapsed_s: float, pace_s: float, budget_s: float) -> int:
    """Total steps of a schedule that should end `budget_s` seconds after its start, now at step
    `step` after `elapsed_s` seconds, at `pace_s` seconds per step; at least step + 1.

    Raises:
        ValueError: pace_s is not > 0.
    """
    if not pace_s > 0:
        raise ValueError(f"pace_s must be > 0 seconds per step, got {pace_s!r}")
    return max(step + 1, step + int((budget_s - elapsed_s) / pace_s))


DEFAULT_MAX_EPOCHS = 3.0  # gpu_run --max-epochs; train-drafter warns above it when continuing a drafter


def epoch_cap_steps(num_sequences: int, batch_size: int, max_epochs: float) -> int:
    """Optimizer steps in `max_epochs` passes over `num_sequences` sequences at `batch_size`
    sequences per step (rounded up; at least 1).

    Why a cap: a time-budgeted run on little data repeats it. On the H200 (Qwen2.5-Coder-0.5B,
    continued from the shipped drafter, held-out HumanEval / MT-bench acceptance at T = 0) runs of
    2.3-2.4 passes gained (sessions 30, 32: 70,943 and 61,451 answers), one of 11.4 passes over
    25,989 answers lost 5 % / 4 % to its own init (session 33) while its training accuracy rose.

    Raises:
        ValueError: num_sequences or batch_size < 1, or max_epochs not > 0.
    """
    if num_sequences < 1 or batch_size < 1:
        raise ValueError(f"num_sequences and batch_size must be >= 1, got {num_sequences}, {batch_size}")
    if not max_epochs > 0:
        raise ValueError(f"max_epochs must be > 0, got {max_epochs!r}")
    return max(1, math.ceil(max_epochs * num_sequences / batch_size))


def replanned_warmup(cfg: TrainConfig, step: int, total: int) -> int:
    """Warmup steps of `cfg`'s schedule re-planned at step `step` to `total` steps (fit_together).

    A warmup already done, or still ending within the new plan at its old share of the plan, is
    kept. One that a shrunken plan would make too long ends at that share of the new plan instead,
    but not before the next step (the rate never steps back down) and always at least one step
    before the end, so that the cosine decay still runs.
    """
    warmup = warmup_length(cfg)
    if warmup <= step:
        return warmup
    share = round(warmup * total / cfg.steps) if total < cfg.steps else warmup
    return max(1, min(warmup, max(step + 1, share), total - 1))


def fit_together(
    trainers: list[Trainer], progress: bool = True, deadline: float | None = None, until: int | None = None,
    budget_seconds: float | None = None, max_steps: int | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> list[dict]:
    """Train several drafters in lockstep on the same batches: the target features, anchors and
    labels of each step are computed once (by trainers[0]) and shared. Stops at the first
    trainer's cfg.steps, at step `until` (an interruption: the schedule still spans cfg.steps) or
    at `deadline` (time.time() seconds); checkpoints every trainer at the end. Returns each
    trainer's last logged summary. The log lines' "seconds" are Trainer.seconds (the run's training
    time, going on from a resumed checkpoint's).

    budget_seconds: the schedule should end this many seconds after the call. cfg.steps is then a
    first estimate: after REPLAN_WARM_STEPS + REPLAN_FIRST steps (sooner in a shorter first plan),
    and again half way through the steps the new plan has left, every trainer's cfg.steps is re-set
    from the pace measured since step REPLAN_WARM_STEPS (`replan_steps`), each trainer's warmup
    length kept in cfg.warmup_steps (`replanned_warmup`: shortened with a shrunken plan). The step count
    then follows the machine's pace; each step's batch and anchors stay a function of the seed.
    Session 29's H200 run planned 2,064 steps for 480 s from 8 timed passes and was done after 264 s.
    max_steps: a re-plan never sets more steps than this (an epoch cap: `epoch_cap_steps`); the
    first plan, cfg.steps, must respect it already.
    should_stop: called after every step; True stops there as `until` would (a Ctrl-C deferred to
    the end of a step: train-drafter's `deferred_interrupt`), without the final validation.

    Validation (trainers[0].cfg.val_every > 0; every trainer then has the same val_data):
    `validation.validate_together` before the first step of a run at step 0 (the starting weights: a
    continued drafter's baseline), after every val_every-th step and after the last (unless that
    step was validated already, also when stopped by `until` or `deadline`); each trainer appends
    it to its val_history and to train_log.jsonl as a line with "split": "val" (training lines
    are unchanged). Its time counts in the re-plan's pace (it recurs with the steps) and may run
    past `deadline` once, at the end. The bar's postfix shows the last validation's tau proxy
    ("val_tau").

    Raises:
        ValueError: the trainers do not share data, target, seed, batch settings, greedy_labels,
            block size, mask token and target_layer_ids (their prepared steps would differ).
    """
    from tqdm.auto import tqdm

    lead = trainers[0]
    _check_shareable(trainers)
    bar = tqdm(total=lead.cfg.steps, initial=lead.step, desc="train", unit="step", disable=not progress)
    windows, last = [StepStats() for _ in trainers], [{} for _ in trainers]
    for tr in trainers:  # the logs' seconds run on from the run's earlier fits (a resumed checkpoint's)
        tr._run_clock(True)
    val_every, val_post = lead.cfg.val_every, {}

    def validate() -> None:
        nonlocal val_post
        for tr, summary in zip(trainers, validation.validate_together(trainers)):
            tr._log_val(summary, tr.seconds())
        val_post = {"val_tau": f"{trainers[0].val_history[-1]['tau_proxy']:.2f}"}
        bar.set_postfix({**(_postfix(last[0]) if last[0] else {}), **val_post})

    if val_every and lead.step == 0:
        validate()
    interrupted = False
    stop = lead.cfg.steps if until is None else min(until, lead.cfg.steps)
    start, clock0 = lead.step, _clock()
    # the first re-plan (and where its pace measurement starts) comes sooner in a short first plan
    next_replan = min(start + REPLAN_WARM_STEPS + REPLAN_FIRST, stop - 1) if budget_seconds is not None else None
    if next_replan is not None and next_replan <= start:
        next_replan = None  # one step planned: nothing to re-plan
    mark_at = None if next_replan is None else min(start + REPLAN_WARM_STEPS, (start + next_replan) // 2)
    mark, first = ((start, clock0) if mark_at == start else None), True
    while lead.step < stop:
        prep = lead.prepare(lead.step)
        for i, tr in enumerate(trainers):
            windows[i].add(*tr.train_step(prep))
        del prep
        bar.update(1)
        step = lead.step
        if next_replan is not None and step == mark_at:
            mark = (step, _clock())
        if next_replan is not None and step == next_replan and mark is not None:
            now = _clock()
            fits = replan_steps(step, now - clock0, (now - mark[1]) / (step - mark[0]), budget_seconds)
            total = fits if max_steps is None else max(step + 1, min(fits, max_steps))
            for tr in trainers:  # each keeps its warmup, shortened only where it would outlast the new plan
                tr.cfg = replace(tr.cfg, steps=total, warmup_steps=replanned_warmup(tr.cfg, step, total))
            warmup = lead.cfg.warmup_steps
            stop = total if until is None else min(until, total)
            bar.total = total
            bar.refresh()
            if progress:  # on stderr with the bar: stdout may carry a command's JSON result
                capped = f", capped at max_steps {total}" if total < fits else ""
                bar.write(f"train: {fits} steps fit the {budget_seconds:.0f} s budget at the pace of steps "
                          f"{mark[0]}-{step}{capped}: schedule re-planned (warmup {warmup} steps)", file=sys.stderr)
            next_replan = step + (total - step) // 2 if first and total - step >= 2 else None
            first = False
        if step % lead.cfg.log_every == 0 or step == lead.cfg.steps:
            for i, tr in enumerate(trainers):
                last[i], windows[i] = tr._log(windows[i], tr.seconds()), StepStats()
            bar.set_postfix({**_postfix(last[0]), **val_post})
        if val_every and step % val_every == 0:
            validate()
        if lead.cfg.ckpt_every and step % lead.cfg.ckpt_every == 0:
            for tr in trainers:
                tr.save_checkpoint()
        if deadline is not None and time.time() > deadline:
            break
        if should_stop is not None and should_stop():
            interrupted = True
            break
    for i, tr in enumerate(trainers):
        if windows[i].steps:
            last[i] = tr._log(windows[i], tr.seconds())
    if val_every and not interrupted and (not lead.val_history or lead.val_history[-1]["step"] != lead.step):
        validate()  # the last weights (not validated yet: a resumed run may have validated this step)
    for tr in trainers:
        tr.save_checkpoint()
        tr._run_clock(False)
    bar.close()
    return last


def _postfix(s: dict) -> dict:
    """tqdm postfix: loss, the tau proxy and top-1 accuracy of slots 1, 2, 4, 8, 15 ("n/a" for a
    slot no label reached in the logged steps: tiny runs with short answers)."""
    acc = s["acc"]
    picks = {f"a{k}": "n/a" if acc[k - 1] is None else f"{acc[k - 1]:.2f}" for k in (1, 2, 4, 8, 15) if k <= len(acc)}
    return {"loss": f"{s['loss']:.3f}", "tau": f"{s['tau_proxy']:.2f}", **picks}


def _check_shareable(trainers: list[Trainer]) -> None:
    lead = trainers[0]
    key = lambda t: (  # noqa: E731
        id(t.data), id(t.target), t.cfg.seed, t.cfg.batch_size, t.cfg.max_len, t.cfg.num_anchors, t.step,
        t.cfg.greedy_labels, id(t.val_data), t.cfg.val_every,
        t.drafter.config.block_size, t.drafter.config.mask_token_id, t.drafter.config.target_layer_ids,
        t.drafter.config.input_embedding_scale,
    )
    for t in trainers[1:]:
        if key(t) != key(lead):
            raise ValueError("drafters trained together must share data, target, seed, batch settings, step, "
                             "greedy_labels, val_data, val_every, block size, mask token and target_layer_ids")


def _as_json(value):
    """A setting as state.json stores it (tuples become lists), for comparing saved and asked values."""
    return json.loads(json.dumps(value))


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    tmp.replace(path)
