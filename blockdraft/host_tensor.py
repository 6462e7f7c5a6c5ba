"""Fast host tensors from Python lists (shared by the sampler and the runner's input building)."""

from __future__ import annotations

import array

import torch

_ARRAY_CODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


def host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """1-D CPU tensor of a Python list of numbers: int64, int32 or float32.

    Goes through `array.array`, about 3x faster than `torch.tensor(list)` (which inspects every
    element); the tensor owns the array's memory.
    """
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_ARRAY_CODES[dtype], values), dtype=dtype)
