"""Token datasets on disk (safetensors, never pickles) and length-bucketed batches.

File layout (one or more shards `data-NNNNN.safetensors` in a folder, read in name order):
    input_ids  [total] int32    all sequences (prompt + target-generated response) concatenated
    loss_mask  [total] uint8    1 on response tokens (the labels), 0 on prompt tokens
    offsets    [n + 1] int64    sequence i is rows offsets[i]:offsets[i+1]
    sampled    [n] uint8        1 if the response was sampled (T > 0), 0 if greedy
metadata (safetensors string map): "info" = JSON (target, generation settings, counts). train-drafter
(training/pipeline.py build_dataset) records among them "target", "vocab_size", "settings" (its data
flags), "device", "seed" and "dtype": the target's dtype while answering ("float32" | "bfloat16"),
which greedy answers depend on at near-ties; data made before it was recorded, or by
training/gpu_run.py (which names it in "generator" only), has no "dtype" (unknown).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockdraft.training.validation import check_val_settings

SHARD_PATTERN = "data-*.safetensors"


@dataclass
class TokenDataset:
    """Sequences of token ids with response masks (see the module docstring for the layout)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    offsets: torch.Tensor
    sampled: torch.Tensor
    info: dict = field(default_factory=dict)

    @classmethod
    def from_pairs(cls, pairs: list[tuple[list[int], list[int]]], sampled: list[bool], info: dict | None = None):
        """Build from (prompt_ids, response_ids) pairs; the loss mask covers the responses."""
        ids, mask, offsets = [], [], [0]
        for prompt, response in pairs:
            ids += list(prompt) + list(response)
            mask += [0] * len(prompt) + [1] * len(response)
            offsets.append(len(ids))
        return cls(
            torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.uint8),
            torch.tensor(offsets, dtype=torch.int64), torch.tensor([int(s) for s in sampled], dtype=torch.uint8),
            dict(info or {}),
        )

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> torch.Tensor:
        """[n] int64 sequence lengths."""
        return self.offsets[1:] - self.offsets[:-1]

    def sequence(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [L] int64, loss_mask [L] bool) of sequence i."""
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.input_ids[lo:hi].long(), self.loss_mask[lo:hi].bool()

    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def token_id_range(self) -> tuple[int, int] | None:
        """(smallest, largest) token id, None when the dataset holds no token."""
        if self.input_ids.numel() == 0:
            return None
        return int(self.input_ids.min()), int(self.input_ids.max())

    def check_token_ids(self, vocab_size: int) -> None:
        """Raises ValueError when a token id lies outside [0, vocab_size): data made for another
        target (the message names the ids found and the recorded target)."""
        ids = self.token_id_range()
        if ids is not None and not (0 <= ids[0] and ids[1] < vocab_size):
            raise ValueError(f"the training data holds token ids {ids[0]}..{ids[1]}, outside the target's vocabulary "
                             f"[0, {vocab_size}): it was made for another target (recorded: "
                             f"{self.info.get('target', 'none')!r}); generate the data with this target")

    def num_anchor_positions(self, max_len: int) -> int:
        """Response tokens that can anchor a training block once each sequence is cut to `max_len`
        tokens (as `collate` cuts them): a response token followed by at least one kept token."""
        lengths = self.lengths()
        seq = torch.repeat_interleave(torch.arange(len(self)), lengths)
        pos = torch.arange(int(self.offsets[-1])) - self.offsets[:-1][seq]
        return int((self.loss_mask.bool() & (pos + 1 < lengths.clamp(max=max_len)[seq])).sum())

    def shortest_prompt(self) -> int:
        """Tokens before the first response token, the fewest over the sequences (0 when empty)."""
        lengths = self.lengths()
        seq = torch.repeat_interleave(torch.arange(len(self)), lengths)
        pos = torch.arange(int(self.offsets[-1])) - self.offsets[:-1][seq]
        first = lengths.clone()  # a sequence without response tokens is all prompt
        resp = self.loss_mask.bool()
        first.scatter_reduce_(0, seq[resp], pos[resp], reduce="amin")
        return int(first.min()) if len(self) else 0

    def save(self, folder: str | Path, shard: int = 0) -> Path:
        """Write this dataset as shard `shard` of `folder` (created), whole or not at all
        (save_safetensors_atomic); returns the file path."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"data-{shard:05d}.safetensors"
        tensors = {"input_ids": self.input_ids, "loss_mask": self.loss_mask, "offsets": self.offsets, "sampled": self.sampled}
        save_safetensors_atomic(tensors, path, {"info": json.dumps(self.info)})
        return path

    @classmethod
    def load(cls, folder: str | Path) -> "TokenDataset":
        """Read and concatenate every shard of `folder` (or one .safetensors file).

        Raises:
            FileNotFoundError: no shard found.
        """
        from safetensors import safe_open

        folder = Path(folder)
        files = [folder] if folder.is_file() else sorted(folder.glob(SHARD_PATTERN))
        if not files:
            raise FileNotFoundError(f"no {SHARD_PATTERN} in {folder}")
        parts = []
        for f in files:
            with safe_open(str(f), framework="pt") as r:
                t = {k: r.get_tensor(k) for k in r.keys()}
                t["info"] = json.loads((r.metadata() or {}).get("info", "{}"))
            parts.append(cls(t["input_ids"], t["loss_mask"], t["offsets"], t["sampled"], t["info"]))
        return cls.concat(parts)

    @classmethod
    def concat(cls, parts: list["TokenDataset"]) -> "TokenDataset":
        """One dataset holding every sequence of `parts`, in order. Its info is the first part's;
        with several parts, the counts (num_sequences, num_tokens, num_response_tokens,
        num_sampled) are those of the whole, and "shards" lists each part's own info."""
        shift, offsets = 0, [torch.zeros(1, dtype=torch.int64)]
        for p in parts:
            offsets.append(p.offsets[1:] + shift)
            shift += int(p.offsets[-1])
        out = cls(
            torch.cat([p.input_ids for p in parts]), torch.cat([p.loss_mask for p in parts]),
            torch.cat(offsets), torch.cat([p.sampled for p in parts]), dict(parts[0].info) if parts else {},
        )
        if len(parts) > 1:
            out.info.update(shards=[p.info for p in parts], num_sequences=len(out), num_tokens=int(out.offsets[-1]),
                            num_response_tokens=out.num_response_tokens(), num_sampled=int(out.sampled.sum()))
        return out

    def select(self, indices: list[int]) -> "TokenDataset":
        """A dataset of sequences `indices` of this one, in that order (info copied, counts updated).

        Raises:
            IndexError: an index outside 0..len-1.
        """
        bad = [i for i in indices if not 0 <= i < len(self)]
        if bad:
            raise IndexError(f"sequence index {bad[0]} outside 0..{len(self) - 1}")
        parts = [self.sequence(i) for i in indices]
        lengths = torch.tensor([len(ids) for ids, _ in parts], dtype=torch.int64)
        offsets = torch.zeros(len(parts) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        cat = (lambda ts, dt: torch.cat(ts).to(dt)) if parts else (lambda ts, dt: torch.zeros(0, dtype=dt))
        out = TokenDataset(cat([ids for ids, _ in parts], torch.int32), cat([m for _, m in parts], torch.uint8),
                           offsets, self.sampled[list(indices)].clone(), dict(self.info))
        out.info.update(num_sequences=len(out), num_tokens=int(out.offsets[-1]),
                        num_response_tokens=out.num_response_tokens(), num_sampled=int(out.sampled.sum()))
        return out


def save_safetensors_atomic(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` to the safetensors file `path` so that `path` only ever holds a whole file:
    written to `path`.tmp, flushed to disk, then renamed over `path` (os.replace). An interrupt
    (a second Ctrl-C, a kill) midway leaves the previous file or none, and at most a stray .tmp,
    never a half file that a later run would read back as data."""
    from blockdraft.weights.save import save_safetensors

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    save_safetensors({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    with open(tmp, "rb") as f:  # renamed only once its bytes are on disk (a crash keeps the old file, not a hole)
        os.fsync(f.fileno())
    os.replace(tmp, path)


# split_validation holds out at most this many sequences: validation runs the target and the drafter
# over all of them (forward only) every TrainConfig.val_every steps, so its cost must not grow with
# the data. 512 answers x 64 anchors give ~32K blocks per slot: a per-slot accuracy to about
# +-0.3 % (one binomial standard deviation at p = 0.5). Its time on the GPU is not measured yet.
MAX_VAL_SEQUENCES = 512
VAL_SPLIT_SEED = 2**40  # + seed: the split's generator (epoch_batches and the anchors use other streams)


def split_validation(data: TokenDataset, fraction: float, seed: int, max_sequences: int = MAX_VAL_SEQUENCES,
                     name: str = "the validation fraction") -> tuple[TokenDataset, TokenDataset | None]:
    """(training part, held-out validation part) of `data`, by whole sequence.

    The validation part is round(fraction x n) sequences (at least 1 when fraction > 0, at most
    `max_sequences`: the rest stays in training), drawn by a seeded permutation: a pure function of
    (len(data), fraction, seed, max_sequences), so a resumed run holds out the same sequences. Both
    parts keep the sequences in their order in `data` (TokenDataset.select: info copied, counts of
    each part). fraction 0 returns (data, None), `data` itself. `name`: the fraction in messages
    (a command passes its flag, "--val-fraction").

    Raises:
        ValueError: fraction not a number in [0, 1) (validation.check_val_settings); max_sequences
            < 1; fraction > 0 leaving no sequence to train on (fewer than 2 sequences, or round(fraction x n) = n; the message
            names the fraction and the sequence count).
    """
    check_val_settings(fraction, fraction_name=name)
    if isinstance(max_sequences, bool) or not isinstance(max_sequences, int) or max_sequences < 1:
        raise ValueError(f"max_sequences must be an integer >= 1, got {max_sequences!r}")
    if fraction == 0:
        return data, None
    n = len(data)
    n_val = max(1, round(fraction * n))
    if n_val >= n:
        raise ValueError(f"{name} {fraction:g} holds out {n_val} of the {n} sequences, leaving none to train on: "
                         f"lower it, or use more data (at least one sequence each side)")
    n_val = min(n_val, max_sequences)
    # its own stream: not the permutations of epoch_batches or sequences_that_fit for the same seed
    order = torch.randperm(n, generator=torch.Generator().manual_seed(VAL_SPLIT_SEED + seed)).tolist()
    val = sorted(order[:n_val])
    held = set(val)
    return data.select([i for i in range(n) if i not in held]), data.select(val)


@dataclass
class Batch:
    """A right-padded batch: input_ids / loss_mask [b, T], lengths [b] (pad id 0, mask 0)."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    lengths: torch.Tensor

    def to(self, device) -> "Batch":
        return Batch(self.input_ids.to(device), self.loss_mask.to(device), self.lengths.to(device))


def collate(data: TokenDataset, indices: list[int], max_len: int, pad_multiple: int = 1) -> Batch:
    """Right-pad sequences `indices` (each cut to `max_len` tokens) into a Batch.

    pad_multiple: the padded width T is rounded up to a multiple of this (never past max_len), so
    that batches come in few distinct shapes (each new shape costs the GPU a slow first step).
    """
    seqs = [data.sequence(i) for i in indices]
    seqs = [(ids[:max_len], mask[:max_len]) for ids, mask in seqs]
    t = max(len(ids) for ids, _ in seqs)
    t = max(t, min(max_len, -(-t // pad_multiple) * pad_multiple))
    input_ids = torch.zeros(len(seqs), t, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), t, dtype=torch.bool)
    for r, (ids, mask) in enumerate(seqs):
        input_ids[r, : len(ids)] = ids
        loss_mask[r, : len(mask)] = mask
    return Batch(input_ids, loss_mask, torch.tensor([len(ids) for ids, _ in seqs]))


def epoch_batches(lengths: torch.Tensor, batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Length-bucketed batches of one epoch, a pure function of (seed, epoch) (so resuming works).

    Sequences are shuffled, sorted by length within windows of 64 batches (less padding), cut into
    batches of `batch_size`, and the batches shuffled again. The last partial batch is kept.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(lengths.numel(), generator=g).tolist()
    window = batch_size * 64
    batches = []
    for lo in range(0, len(order), window):
        chunk = sorted(order[lo : lo + window], key=lambda i: int(lengths[i]))
        batches += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size)]
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[p] for p in perm]


def data_settings_differences(made: dict, asked: dict) -> list[tuple[str, object, object]]:
    """(name, recorded, asked) for each data setting in `asked` that a dataset's info["settings"]
    (`made`) records with another value, in the order of `asked`; settings it does not record are
    not compared.

    A dataset that records synth_prompts but no synth_openers was made before --synth-openers, when
    the requests started bare: it counts as "none". synth_openers is not compared when the dataset
    holds no synthesized request and none is asked for (synth_prompts 0 on both sides; when
    `asked` has no synth_prompts, the dataset's stands): the openers then changed nothing.
    """
    if "synth_prompts" in made:
        made = {"synth_openers": "none", **made}
        if made["synth_prompts"] == 0 and asked.get("synth_prompts", 0) == 0:  # absent: the dataset's 0
            asked = {k: v for k, v in asked.items() if k != "synth_openers"}
    return [(name, made[name], value) for name, value in asked.items() if name in made and made[name] != value]
