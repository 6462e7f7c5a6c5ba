"""Host <-> device transfers of one step without hidden synchronisation.

A plain `tensor.to("cuda")` from pageable memory (and `torch.tensor(list, device="cuda")`) is a
synchronous copy; a step on the GPU path must not have any. Host arrays are therefore packed into
one pinned buffer per dtype and copied with non_blocking=True (the caching host allocator keeps
the pinned buffer alive until the copy has run). The only wait of a step is its output's fetch
(`start_fetch` when the step is launched, `PendingFetch.wait` when it is read).
"""

from __future__ import annotations

import torch

def stage_to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Move CPU tensors to `device`: one asynchronous host->device copy per dtype on CUDA.

    Args:
        tensors: name -> CPU tensor (any shape; made contiguous).
        device: target device; on a CPU device the tensors come back unchanged.
    Returns:
        name -> tensor on `device` with the same shape and dtype (on CUDA, views into one
        buffer per dtype; do not resize them).
    """
    if device.type != "cuda":
        return dict(tensors)
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append(name)
    out: dict[str, torch.Tensor] = {}
    for dtype, names in by_dtype.items():
        sizes = [tensors[n].numel() for n in names]
        host = torch.empty(sum(sizes), dtype=dtype, pin_memory=True)
        torch.cat([tensors[n].reshape(-1) for n in names], out=host)
        flat = host.to(device, non_blocking=True)
        for name, part in zip(names, flat.split(sizes)):
            out[name] = part.view(tensors[name].shape)
    return out


class PendingFetch:
    """A device -> host copy in flight (`start_fetch`); `wait()` returns the host tensor."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cuda":
            self._host, self._done = tensor, None
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()

    def wait(self) -> torch.Tensor:
        """THE host synchronisation of a step: wait for the copy (hence for all stream work enqueued
        before `start_fetch`, and nothing enqueued after it), return the host tensor."""
        if self._done is not None:
            self._done.synchronize()
        return self._host


def start_fetch(tensor: torch.Tensor) -> PendingFetch:
    """Start copying a device tensor to the host without waiting (CPU: the tensor itself).

    On CUDA: a non_blocking copy into pinned memory and an event recorded right after it, so a
    later `wait()` does not also wait for work enqueued in between (async scheduling's next step).
    """
    return PendingFetch(tensor)

