"""Host <-> device transfers of one step without hidden synchronisation.

A plain `tensor.to("cuda")` from pageable memory (and `torch.tensor(list, device="cuda")`) is a
synchronous copy; a step on the GPU path must not have any. Host arrays are therefore packed into
one pinned buffer per dtype and copied with non_blocking=True (the caching host allocator keeps
the pinned buffer alive until the copy has run). The only wait of a step is `fetch_to_host`.
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


def fetch_to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Copy a device tensor to the host and wait for it: THE host synchronisation of a step.

    On CUDA: non_blocking copy into pinned memory, then wait on an event recorded after it (the
    stream's earlier work, i.e. the whole step, has finished when the event has). On CPU: the
    tensor itself.
    """
    if tensor.device.type != "cuda":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host
