"""Random weights drawn on the parameters' own device (GPU benchmarks and tests of large shapes).

`CausalLM.init_random_weights_` draws on the CPU (device-independent values), which takes minutes
for an 8B model; this fills each parameter in place with a generator on its device instead.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def fill_random_(module: nn.Module, std: float = 0.02, seed: int = 0) -> nn.Module:
    """Fill every parameter of `module` in place and return it.

    Parameters whose name contains "norm" get N(1, 0.1) (so norm weights matter), all others
    N(0, std). Values depend on the device's generator, so CPU and CUDA fills differ.
    Raises:
        ValueError: `module` has no parameters (e.g. its weights were packed for oneDNN).
    """
    params = list(module.named_parameters())
    if not params:
        raise ValueError("module has no parameters to fill (packed weights are not supported)")
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in params:
        if p.device not in generators:
            generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        mean, scale = (1.0, 0.1) if "norm" in name else (0.0, std)
        p.normal_(mean, scale, generator=generators[p.device])
    return module
