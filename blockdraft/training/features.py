"""Target features of a whole dataset, computed once and kept in memory for every epoch.

The target is frozen, so the features at `target_layer_ids` of a sequence are the same in every
epoch. Recomputing them each step is most of a step's work (a 0.5B target forward over 16 x 1024
tokens against a 2-layer drafter), so a multi-epoch run computes them once per sequence instead:
tokens x len(layer_ids) x hidden x 2 bytes in bf16 (Qwen2.5-0.5B, 3 layers, 1.7M tokens: 9.1 GB).
Sequences are cut to the trainer's max_len exactly as `dataset.collate` cuts them.

A cache larger than the GPU can hold splits in two (`FeatureCache.build(device_bytes=...)`): the
first sequences on the GPU, the rest in pinned host memory, copied to the GPU per batch (a step of
64 x ~400 tokens reads ~140 MB, a few ms over PCIe against ~145 ms of training on the H200).
"""

from __future__ import annotations

import os
import weakref

import torch

from blockdraft.training.dataset import TokenDataset, collate
from blockdraft.training.target import TrainTarget


class FeatureCache:
    """Every sequence's target features, packed: `feats` [device_tokens, F] and, when the cache
    was split, `host_feats` [total_tokens - device_tokens, F] (pinned CPU memory); `offsets` [n + 1].

    Sequence i holds rows offsets[i]:offsets[i+1] of the two tensors stacked (its first
    min(length, max_len) tokens), the outputs of target layers `layer_ids` (what the Trainer checks
    against its drafter and config). Sequences never straddle the split: the first `device_rows`
    rows are in `feats`, the rest in `host_feats`. `greedy` [total_tokens] int32 on the device
    (built with greedy=True, else None): the target's argmax next token after each cached
    position, for TrainConfig.greedy_labels.
    """

    def __init__(self, feats: torch.Tensor, offsets: torch.Tensor, max_len: int, layer_ids: tuple[int, ...],
                 host_feats: torch.Tensor | None = None, greedy: torch.Tensor | None = None) -> None:
        self.feats, self.offsets, self.max_len, self.layer_ids = feats, offsets.tolist(), max_len, tuple(layer_ids)
        self.host_feats, self.greedy = host_feats, greedy
        self.device_rows = feats.shape[0]

    @property
    def num_tokens(self) -> int:
        """Tokens cached, on the device and on the host."""
        return self.offsets[-1]

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self.offsets) - 1

    @classmethod
    @torch.no_grad()
    def build(cls, target: TrainTarget, data: TokenDataset, layer_ids: tuple[int, ...], max_len: int, device,
              dtype: torch.dtype | None = None, batch_size: int = 16, progress: bool = False,
              device_bytes: int | None = None, greedy: bool = False) -> "FeatureCache":
        """Run the target over every sequence once (length-sorted batches of `batch_size`).

        Args:
            target: a TrainTarget (training/target.py). data: the dataset. layer_ids: feature ids.
            max_len: tokens kept per sequence (the trainer's TrainConfig.max_len).
            device: where the cache lives (the trainer's device). dtype: storage dtype (default: the
                target's feature dtype, bf16 for a bf16 target).
            device_bytes: at most this many bytes of the cache on `device` (None: all of it): the
                first sequences (by index) that fit stay there, the rest go to host memory (pinned
                when CUDA is available).
            greedy: also keep the target's argmax next token at every position (4 bytes per token,
                on `device`; TrainTarget.features_and_greedy).
        Raises:
            ValueError: the cache does not fit in the free memory of a CUDA `device` (the message
                gives the bytes needed and free; train without the cache then); no sequences; token ids outside
                the target's vocabulary (TokenDataset.check_token_ids).
        """
        from tqdm.auto import tqdm

        if len(data) == 0:
            raise ValueError("the feature cache needs at least one sequence, got an empty dataset")
        data.check_token_ids(target.vocab_size)
        device = torch.device(device)
        lengths = data.lengths().clamp(max=max_len)
        offsets = torch.zeros(len(data) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        order = sorted(range(len(data)), key=lambda i: int(lengths[i]))
        feats, best = None, None
        if greedy:
            best = torch.zeros(int(offsets[-1]), dtype=torch.int32, device=device)
        bar = tqdm(total=len(data), desc="target features", unit="seq", disable=not progress)
        for lo in range(0, len(order), batch_size):
            idx = order[lo : lo + batch_size]
            batch = collate(data, idx, max_len).to(device)
            if greedy:
                f, g = target.features_and_greedy(batch.input_ids, batch.lengths, tuple(layer_ids))
            else:
                f = target.features(batch.input_ids, batch.lengths, tuple(layer_ids))
            if feats is None:
                dtype = dtype or f.dtype
                row_bytes = f.shape[-1] * torch.empty((), dtype=dtype).element_size()
                split = device_split(offsets, row_bytes, device_bytes)
                _check_fits(split * row_bytes, device)
                feats = torch.empty(split, f.shape[-1], dtype=dtype, device=device)
                host = None
                if split < int(offsets[-1]):
                    host = host_buffer(int(offsets[-1]) - split, f.shape[-1], dtype)
            for r, i in enumerate(idx):
                lo, hi = int(offsets[i]), int(offsets[i + 1])
                if greedy:
                    best[lo:hi] = g[r, : hi - lo].to(torch.int32)
                if hi <= split:
                    feats[lo:hi] = f[r, : hi - lo]
                else:
                    host[lo - split : hi - split] = f[r, : hi - lo]
            bar.update(len(idx))
        bar.close()
        return cls(feats, offsets, max_len, layer_ids, host_feats=host, greedy=best)

    def batch(self, indices: list[int], t: int) -> torch.Tensor:
        """Right-padded features [len(indices), t, F] of sequences `indices` (the rows of
        `collate(data, indices, max_len)`; padding rows are zero), on the cache's device. t >=
        every kept length."""
        out = self.feats.new_zeros(len(indices), t, self.feats.shape[1])
        split = self.device_rows
        for r, i in enumerate(indices):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            if hi <= split:
                out[r, : hi - lo] = self.feats[lo:hi]
            else:  # from pinned host memory: an asynchronous copy on the current stream
                out[r, : hi - lo].copy_(self.host_feats[lo - split : hi - split], non_blocking=True)
        return out

    def greedy_batch(self, indices: list[int], t: int) -> torch.Tensor:
        """Right-padded greedy next tokens [len(indices), t] int64 of sequences `indices` (padding 0).

        Raises:
            ValueError: the cache was built without greedy=True.
        """
        if self.greedy is None:
            raise ValueError("this feature cache holds no greedy tokens: build it with greedy=True")
        out = torch.zeros(len(indices), t, dtype=torch.long, device=self.greedy.device)
        for r, i in enumerate(indices):
            lo, hi = self.offsets[i], self.offsets[i + 1]
            out[r, : hi - lo] = self.greedy[lo:hi]
        return out


def device_split(offsets: torch.Tensor, row_bytes: int, device_bytes: int | None) -> int:
    """Rows of a cache with sequence boundaries `offsets` [n + 1] that stay on the device: all of
    them when `device_bytes` is None or enough, else up to the last sequence boundary within
    `device_bytes` (rows of `row_bytes` bytes each).

    Raises:
        ValueError: device_bytes < 0.
    """
    if device_bytes is not None and device_bytes < 0:
        raise ValueError(f"device_bytes must be >= 0 bytes or None, got {device_bytes}")
    total = int(offsets[-1])
    if device_bytes is None or total * row_bytes <= device_bytes:
        return total
    fit = device_bytes // row_bytes
    return int(offsets[int(torch.searchsorted(offsets, torch.tensor(fit), right=True)) - 1])


def sequences_that_fit(data: TokenDataset, max_len: int, bytes_per_token: int, budget_bytes: int,
                       seed: int = 0) -> list[int] | None:
    """Which sequences a feature cache of `budget_bytes` can hold.

    Args:
        max_len: tokens kept per sequence (as FeatureCache.build keeps them).
        bytes_per_token: one token's features (num feature layers x hidden size x dtype bytes).
    Returns:
        None when every sequence fits; else a seeded random subset's indices (sorted) whose tokens
        fit, so training on more data than fits in memory uses as much of it as does (unbiased by
        shard or length).
    """
    lengths = data.lengths().clamp(max=max_len)
    if int(lengths.sum()) * bytes_per_token <= budget_bytes:
        return None
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))
    keep = torch.cumsum(lengths[order], 0) * bytes_per_token <= budget_bytes
    return sorted(order[keep].tolist())


def host_buffer(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised [rows, cols] tensor in host memory, page-locked where CUDA is available so
    that copies to the GPU run asynchronously. Registered as allocated: torch's pin_memory=True
    rounds each allocation up to a power of two (48 GiB would lock 64).

    Raises:
        ValueError: it needs more than 90 % of the host memory available now (names both).
    """
    nbytes = rows * cols * torch.empty((), dtype=dtype).element_size()
    available = available_host_bytes()
    if nbytes > 0.9 * available:
        raise ValueError(f"the host part of the feature cache needs {nbytes / 2**30:.1f} GiB but only "
                         f"{available / 2**30:.1f} GiB of host memory is available: lower --cache-host-gib")
    t = torch.empty(rows, cols, dtype=dtype)
    if torch.cuda.is_available() and nbytes:
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, 1))  # 1: cudaHostRegisterPortable
        if err:
            raise RuntimeError(f"page-locking {nbytes / 2**30:.1f} GiB of host memory failed (cudaError {err})")
        weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


def available_host_bytes() -> int:
    """Host memory available to a new allocation (bytes): /proc/meminfo's MemAvailable (free memory
    plus reclaimable page cache), else the free pages sysconf counts."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_fits(nbytes: int, device: torch.device) -> None:
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes > 0.8 * free:  # leave room for the target, the drafter and the step's activations
        raise ValueError(f"the target feature cache needs {nbytes / 2**30:.1f} GiB but only {free / 2**30:.1f} GiB "
                         f"of GPU memory is free; train without it (recompute features each step) or on less data")
