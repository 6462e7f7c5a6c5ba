"""The draft vocabulary: the N most frequent target tokens that the drafter's LM head scores.

The DFlash drafter scores its K draft rows with the TARGET's LM head, [V, H]: for a 152k-token
vocabulary that matmul is a large share of a draft step (and on the GPU re-reads the whole head
every step). FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models
via Frequency-Ranked Speculative Sampling") restricts the draft head to the N most frequent tokens
(EAGLE-3's draft vocabulary, `d2t` / `t2d`, is the same idea): the head costs ~N/V, verification
is untouched, so the output is still exactly the target's; only drafts outside the slice are lost.

File `draft_vocab.json` in a drafter folder (plain JSON, not a `*.safetensors` file: vLLM and
SGLang load every `*.safetensors` of a folder without an index as weights):
    "format"     "blockdraft-draft-vocab/1"
    "token_ids"  [N_max] target token ids, most frequent first (the always-included ids lead:
                 `leading_ids`, the EOS ids then the pad id); every prefix is a draft vocabulary
    "counts"     [N_max] how often each id occurred among the counted (response) tokens
    "metadata"   {"source": str, "num_tokens": counted tokens, ...}

`--draft-vocab-size N` picks the first N ids (0 = the full vocabulary, no slice).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from blockdraft.errors import param_error

DRAFT_VOCAB_FILE = "draft_vocab.json"
_FORMAT = "blockdraft-draft-vocab/1"


def leading_ids(eos_ids: Iterable[int], pad_id: int | None) -> tuple[int, ...]:
    """The ids a draft vocabulary puts first whatever their counts: the target's EOS ids (sorted),
    then its pad id unless it is one of them (None: none added).

    The pad id is included because some targets also stop on it and it rarely or never occurs in
    the training answers, so a frequency ranking alone could leave it out of the slice. (Qwen2.5's
    `<|endoftext|>`, 151643, is its pad token and an EOS id of its generation_config.json; since
    the engine stops on it too, model_loader.model_eos_ids lists it among the EOS ids.)
    Args:
        eos_ids: the target's stop ids (any order, duplicates allowed). pad_id: its pad id or None.
    Returns:
        The ids, deduplicated: sorted EOS ids, then the pad id if new.
    """
    lead = sorted({int(i) for i in eos_ids})
    if pad_id is not None and int(pad_id) not in lead:
        lead.append(int(pad_id))
    return tuple(lead)


def rank_tokens(
    sequences: Iterable[tuple[torch.Tensor, torch.Tensor]],
    vocab_size: int,
    always_include: Sequence[int] = (),
    max_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Rank token ids by how often they occur where the loss mask is set (response tokens).

    Order: `always_include` first (in the given order, duplicates dropped), then every other id by
    count, most frequent first, ties broken by the smaller id (deterministic). Ids that never occur
    still rank (by id) so the ranking covers the whole vocabulary unless `max_size` cuts it.
    Args:
        sequences: (token_ids [L] int, loss_mask [L] bool/int) pairs; only masked tokens count.
        vocab_size: V; every counted id and every always-included id must be in [0, V).
        always_include: ids placed at the front whatever their counts (EOS / stop ids: a draft of
            the end of an answer must stay possible).
        max_size: keep the first `max_size` ids (None: all V).
    Returns:
        (token_ids [N] int64, counts [N] int64, number of counted tokens), N = min(max_size, V).
    Raises:
        ValueError: vocab_size < 1, max_size < 1 or smaller than the always-included ids, an id
            outside [0, V), or a sequence whose ids and mask differ in length.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    front = list(dict.fromkeys(int(i) for i in always_include))
    bad = [i for i in front if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"always-included ids {bad} are outside the vocabulary [0, {vocab_size})")
    size = vocab_size if max_size is None else max_size
    if size < max(1, len(front)):
        raise ValueError(f"max_size must be >= max(1, {len(front)} always-included ids), got {max_size}")
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i, (ids, mask) in enumerate(sequences):
        if ids.shape != mask.shape:
            raise ValueError(f"sequence {i}: token ids {tuple(ids.shape)} and loss mask {tuple(mask.shape)} differ")
        counted = ids[mask.bool()].long()
        if counted.numel() and (int(counted.min()) < 0 or int(counted.max()) >= vocab_size):
            raise ValueError(f"sequence {i} holds token ids outside the vocabulary [0, {vocab_size})")
        counts += torch.bincount(counted, minlength=vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: equal counts keep id order
    if front:
        front_t = torch.tensor(front, dtype=torch.int64)
        order = torch.cat([front_t, order[~torch.isin(order, front_t)]])
    order = order[:size]
    return order, counts[order], int(counts.sum())


def rank_dataset(data, vocab_size: int, always_include: Sequence[int] = (), max_size: int | None = None):
    """`rank_tokens` over a blockdraft.training.dataset.TokenDataset (its response tokens)."""
    return rank_tokens((data.sequence(i) for i in range(len(data))), vocab_size, always_include, max_size)


# Ranked ids a drafter export keeps: any draft vocabulary up to 64K (the useful range: FR-Spec
# reports 16K-32K for 128K-152K vocabularies) can be picked later; ~1 MB.
EXPORT_MAX_IDS = 65536


def write_dataset_draft_vocab(
    folder: str | Path, data, vocab_size: int, always_include: Sequence[int], source: str,
    max_size: int = EXPORT_MAX_IDS,
) -> Path:
    """Rank a TokenDataset's response tokens (`rank_dataset`) with `always_include` (the target's
    `leading_ids`: EOS ids, then pad) in front and write the first min(max_size, V) ids to
    `<folder>/draft_vocab.json`.

    Returns the file. Raises: ValueError as `rank_tokens`.
    """
    ids, counts, total = rank_dataset(data, vocab_size, always_include, min(max_size, vocab_size))
    meta = {"source": source, "num_tokens": total, "num_sequences": len(data), "vocab_size": vocab_size,
            "always_included": [int(i) for i in dict.fromkeys(always_include)]}
    return save_draft_vocab(folder, ids, counts, meta)


def coverage(ranked: torch.Tensor, tokens: torch.Tensor, sizes: Sequence[int]) -> dict[int, float]:
    """Fraction of `tokens` (any shape, int ids) inside the first N ids of `ranked`, per N in sizes.

    The share of positions whose target token the draft head can still propose (an upper bound on
    the acceptance a draft vocabulary keeps). Returns {N: fraction in [0, 1]} (nan for no tokens).
    """
    flat = tokens.reshape(-1).long()
    out = {}
    for n in sizes:
        out[int(n)] = float(torch.isin(flat, ranked[:n]).float().mean()) if flat.numel() else float("nan")
    return out


def save_draft_vocab(folder: str | Path, token_ids: torch.Tensor, counts: torch.Tensor, metadata: dict) -> Path:
    """Write `<folder>/draft_vocab.json`; returns the file.

    Args:
        folder: where to write (usually the drafter's folder); created with its parents if missing.
            An existing draft_vocab.json there is overwritten.
        token_ids / counts: [N] int ranked ids and their counts (see `rank_tokens`).
        metadata: JSON-serialisable; should hold "source" (what was counted) and "num_tokens".
    Raises:
        ValueError: empty or mismatched tensors, repeated or negative ids.
        OSError: the folder cannot be created or the file written.
    """
    token_ids, counts = token_ids.detach().cpu().long().contiguous(), counts.detach().cpu().long().contiguous()
    _check_ids(token_ids, counts, "token_ids")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / DRAFT_VOCAB_FILE
    data = {"format": _FORMAT, "metadata": metadata, "token_ids": token_ids.tolist(), "counts": counts.tolist()}
    file.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return file


def _read(file: Path) -> dict:
    """Parse and check a draft_vocab.json: the dict with "token_ids" / "counts" as int64 tensors.

    Raises:
        ValueError: not JSON, another format, missing or malformed ids / counts.
    """
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not a readable draft vocabulary (JSON): {e}") from e
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{file}: format must be {_FORMAT!r}, got {found!r}")
    ids, counts = data.get("token_ids"), data.get("counts")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{file}: 'token_ids' must be a list of integers")
    if counts is None:
        counts = [0] * len(ids)
    if not isinstance(counts, list) or not all(isinstance(c, int) for c in counts):
        raise ValueError(f"{file}: 'counts' must be a list of integers")
    data["token_ids"] = torch.tensor(ids, dtype=torch.int64)
    data["counts"] = torch.tensor(counts, dtype=torch.int64)
    _check_ids(data["token_ids"], data["counts"], f"{file}: token_ids")
    return data


def draft_vocab_capacity(folder: str | Path) -> int | None:
    """How many ranked ids `<folder>/draft_vocab.json` holds, or None when the folder has none.

    Raises:
        ValueError: the file is not a valid draft vocabulary (see `_read`).
    """
    file = Path(folder) / DRAFT_VOCAB_FILE
    if not file.is_file():
        return None
    return int(_read(file)["token_ids"].numel())


# Smallest useful draft vocabulary: at 256 ids the sliced head already costs little next to the
# drafter's layers, so fewer ids save almost no time and only lose the drafts outside them.
MIN_DRAFT_VOCAB_SIZE = 256


def min_draft_vocab_size(vocab_size: int) -> int:
    """The smallest draft vocabulary allowed for a target vocabulary of `vocab_size` ids:
    MIN_DRAFT_VOCAB_SIZE, or 1/16 of the vocabulary when that is smaller (tiny test vocabularies,
    so that proper slices of them stay possible), at least 1."""
    return max(1, min(MIN_DRAFT_VOCAB_SIZE, vocab_size // 16))


def check_draft_vocab_size(size, folder: str | Path, vocab_size: int | None = None) -> int:
    """The one check of a draft vocabulary size against a drafter folder; returns the size.

    0 means the full vocabulary (no file needed); N >= 1 needs `<folder>/draft_vocab.json`
    with at least N ranked ids, and, when the target's vocabulary size V is given,
    N >= min_draft_vocab_size(V) (256 for real vocabularies).
    Raises:
        ValueError: not an integer >= 0, N larger than the ids in the file or below
            min_draft_vocab_size(V) (both name the file and the allowed range [minimum, ids in the
            file]; the second also why), or a file ranking fewer ids than that minimum.
        FileNotFoundError: N >= 1 and the folder has no draft_vocab.json (names the folder, what
            writes one (train-drafter) and the sizes allowed once it exists).
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise param_error("draft_vocab_size", f"draft_vocab_size must be an integer >= 0 (0: full vocabulary), "
                                              f"got {size!r}")
    if size == 0:
        return 0
    capacity = draft_vocab_capacity(folder)
    low = 1 if vocab_size is None else min_draft_vocab_size(vocab_size)
    if capacity is None:
        # Said as a user does it: which command writes the file, and the sizes it then allows.
        least = f"{low}" if vocab_size is not None else f"{MIN_DRAFT_VOCAB_SIZE} (for a vocabulary under 4096 ids: 1/16 of it)"
        raise param_error("draft_vocab_size", (
            f"draft_vocab_size {size} needs the drafter's ranked vocabulary, but drafter folder {folder} has no "
            f"{DRAFT_VOCAB_FILE}; use 0 (the full vocabulary, no file needed), or a drafter that has one: "
            f"`blockdraft train-drafter` writes it into OUT/drafter, ranked from the training answers (for a drafter "
            f"trained elsewhere, scripts/rank_draft_vocab.py shows how to rank one from its training data). With the "
            f"file, draft_vocab_size must be 0 or at least {least} and at most the ids it ranks"), FileNotFoundError)
    file = Path(folder) / DRAFT_VOCAB_FILE
    if capacity < low:
        raise param_error("draft_vocab_size", f"draft_vocab_size {size} cannot be used with {file}: it ranks only "
                          f"{capacity} ids, fewer than the {low} a target vocabulary of {vocab_size} ids needs at "
                          f"least; use 0 (full vocabulary) or rank at least {low} ids")
    if size > capacity:
        target = "" if vocab_size is None else f"a target vocabulary of {vocab_size} ids and "
        raise param_error("draft_vocab_size", f"draft_vocab_size must be 0 (full vocabulary) or in [{low}, {capacity}] "
                          f"for {target}{file} ({capacity} ranked ids), got {size}")
    if size < low:
        raise param_error("draft_vocab_size", (
            f"draft_vocab_size must be 0 (full vocabulary) or in [{low}, {capacity}] for a "
            f"target vocabulary of {vocab_size} ids and {Path(folder) / DRAFT_VOCAB_FILE}, got {size}: a draft "
            f"vocabulary under {low} ids saves almost no time over {low} (the head is already a small part of a draft "
            f"step) and loses the drafts outside it"))
    return size


def load_draft_vocab(folder: str | Path, size: int, vocab_size: int | None = None) -> torch.Tensor:
    """The first `size` ranked ids of `<folder>/draft_vocab.json` -> [size] int64 (CPU).

    vocab_size: the target's V; when given, every loaded id must be below it and `size` at least
        min_draft_vocab_size(V).
    Raises:
        FileNotFoundError / ValueError: as `check_draft_vocab_size` (size 0 is refused here: there
            is nothing to load), a corrupt file (wrong dtype, repeated or negative ids), or an id
            >= vocab_size (a vocabulary ranked for another target).
    """
    if check_draft_vocab_size(size, folder, vocab_size) == 0:
        raise ValueError(f"load_draft_vocab needs size >= 1 (0 means the full vocabulary: no draft vocabulary), "
                         f"got {size}")
    file = Path(folder) / DRAFT_VOCAB_FILE
    ids = _read(file)["token_ids"][:size].clone()
    if vocab_size is not None and int(ids.max()) >= vocab_size:
        raise ValueError(f"{file} holds token id {int(ids.max())} among its first {size}, outside the target's "
                         f"vocabulary [0, {vocab_size}): was it ranked for another target?")
    return ids


def read_draft_vocab_metadata(folder: str | Path) -> dict:
    """The "metadata" of `<folder>/draft_vocab.json` ({} when it has none).

    Raises:
        FileNotFoundError: no such file. ValueError: not a valid draft vocabulary.
    """
    file = Path(folder) / DRAFT_VOCAB_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no {DRAFT_VOCAB_FILE} in {folder}")
    return _read(file).get("metadata") or {}


def _check_ids(ids: torch.Tensor, counts: torch.Tensor, what: str) -> None:
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"{what} must be a non-empty 1-D tensor, got shape {list(ids.shape)}")
    if counts.shape != ids.shape:
        raise ValueError(f"{what} has {ids.numel()} ids but counts has shape {list(counts.shape)}")
    if int(ids.min()) < 0:
        raise ValueError(f"{what} holds negative ids")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{what} holds repeated ids")


class DraftHead:
    """The target's LM head restricted to a draft vocabulary: rows of the ranked ids.

    Attributes:
        token_ids: [N] int64 target ids of the draft vocabulary (on the head's device); draft-vocab
            column j scores target token token_ids[j].
        weight: [N, H] copy of the target's LM-head rows (tied models: embedding rows), its dtype.
        packed: oneDNN-packed copy of `weight` (CPU fp32 / bf16; see blockdraft.layers.linear) or None.
    """

    def __init__(self, token_ids: torch.Tensor, weight: torch.Tensor) -> None:
        """
        Args:
            token_ids: [N] int ranked target ids. weight: [N, H] their LM-head rows.
        Raises:
            ValueError: shapes that do not match.
        """
        from blockdraft.layers.linear import cpu_packing_supported, pack_weight

        if token_ids.dim() != 1 or weight.dim() != 2 or weight.shape[0] != token_ids.shape[0]:
            raise ValueError(f"DraftHead needs token_ids [N] and weight [N, H], got {list(token_ids.shape)} "
                             f"and {list(weight.shape)}")
        self.weight = weight.detach().contiguous()
        self.token_ids = token_ids.to(device=weight.device, dtype=torch.long)
        self.packed = pack_weight(self.weight) if cpu_packing_supported(weight.dtype, weight.device) else None

    @classmethod
    def from_target(cls, target, token_ids: torch.Tensor) -> "DraftHead":
        """Gather the rows of `token_ids` [N] from `target.lm_head_rows` (blockdraft CausalLM).

        Raises:
            ValueError: an id outside the target's vocabulary.
        """
        return cls(token_ids, target.lm_head_rows(token_ids))

    @property
    def size(self) -> int:
        """N, the number of draft-vocabulary columns."""
        return self.token_ids.shape[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H] -> logits [M, N] in the weight dtype; column j = target token token_ids[j]."""
        from blockdraft.layers.linear import packed_linear

        if self.packed is not None:
            return packed_linear(hidden, self.packed, None)
        return torch.nn.functional.linear(hidden, self.weight)

    def to_target_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """Draft-vocab column indices (any shape, int) -> target token ids (same shape, int64).

        One device-side gather: no host sync, so it is captured in the step's tail CUDA graph.
        """
        return self.token_ids[indices]


def build_draft_head(target, folder: str | Path | None, size: int) -> DraftHead | None:
    """The DraftHead of the first `size` ids of `<folder>/draft_vocab.json` over `target`'s
    LM head (blockdraft CausalLM), or None when size is 0 (the full vocabulary).

    Raises:
        FileNotFoundError / ValueError: as `load_draft_vocab` (with the target's vocabulary size).
    """
    if size == 0:
        return None
    return DraftHead.from_target(target, load_draft_vocab(folder, size, target.config.vocab_size))
