"""Linear layers with a selectable weight layout, stacked projections, and HF-name weight loading.

Layout: HF stores a projection as [out, in] and computes x @ W.T. On CPU in float32, MKL's
kernels for that layout are much slower for small row counts (decode, verify) than x @ Wt with
the weight stored transposed, [in, out]: measured on the 2-core AMD EPYC dev box, 1 thread, batch 1,
Qwen2.5-0.5B shapes: 24 layers 100 -> 76 ms, LM head 40 -> 23 ms; bf16 is the other way round.
So each layer takes `transposed` (chosen once per model, see `blockdraft.models.build_model`), and
`hf_view` gives the loader an [out, in] view either way.

Stacking: q/k/v (and gate/up) live in one matrix so a layer runs one matmul instead of three;
`StackedLinear.shard_rows` records which output rows each HF projection fills.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
from torch import nn
from torch.nn import functional as F


class Linear(nn.Module):
    """y = x @ W.T + b with W stored [out, in] (HF layout) or, if `transposed`, as Wt [in, out].

    Input [rows, in_features] -> [rows, out_features], in the parameters' dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, transposed: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.transposed = in_features, out_features, transposed
        shape = (in_features, out_features) if transposed else (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return x @ self.weight
        return torch.addmm(self.bias, x, self.weight)

    def hf_view(self, param: str) -> torch.Tensor:
        """The parameter's data as HF lays it out (weight [out, in]); a view, writable."""
        data = getattr(self, param).data
        return data.t() if self.transposed and param == "weight" else data

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, transposed={self.transposed}"


class StackedLinear(Linear):
    """Linear whose output features are the concatenation of named HF projections (shards).

    Args:
        in_features: input size.
        shards: ordered (hf_name, out_features) pairs, e.g. [("q_proj", 896), ("k_proj", 128), ...].
        bias: whether every shard carries a bias.
        transposed: weight layout, see Linear.
    """

    def __init__(self, in_features: int, shards: list[tuple[str, int]], bias: bool = False, transposed: bool = False):
        super().__init__(in_features, sum(size for _, size in shards), bias=bias, transposed=transposed)
        self.shard_rows: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards:
            self.shard_rows[name] = (start, start + size)
            start += size

    def load_shard(self, shard: str, param: str, tensor: torch.Tensor) -> None:
        """Copy an HF tensor (`param` is "weight" or "bias") into its output rows.

        Raises:
            ValueError: shape mismatch (names the shard and both shapes).
        """
        lo, hi = self.shard_rows[shard]
        _checked_copy(self.hf_view(param)[lo:hi], tensor, f"{shard}.{param}")


def _checked_copy(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if target.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)


def hf_param_names(module: nn.Module) -> dict[str, tuple[str, str | None]]:
    """Map every HF checkpoint name the module expects -> (our parameter name, shard or None).

    Stacked layers expand into one HF name per shard: `x.qkv_proj.weight` yields
    `x.q_proj.weight`, `x.k_proj.weight`, `x.v_proj.weight`.
    """
    names: dict[str, tuple[str, str | None]] = {}
    stacked = {prefix: m for prefix, m in module.named_modules() if isinstance(m, StackedLinear)}
    for ours, _ in module.named_parameters():
        prefix, _, param = ours.rpartition(".")
        if prefix in stacked:
            parent = prefix.rpartition(".")[0]
            for shard in stacked[prefix].shard_rows:
                names[f"{parent}.{shard}.{param}" if parent else f"{shard}.{param}"] = (ours, shard)
        else:
            names[ours] = (ours, None)
    return names


def load_hf_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor], ignore: Iterable[str] = ()) -> None:
    """Copy an HF-named state dict into `module` (stacked / transposed layers included), all or nothing.

    Args:
        module: the model; its parameter names mirror HF except stacked layers.
        state_dict: HF names -> tensors in HF layout (any float dtype; cast on copy).
        ignore: regexes of checkpoint names that are legitimately unused (e.g. rotary buffers).
    Raises:
        ValueError: missing or unexpected keys (first few of each, with counts), or a shape
            mismatch. Nothing is copied when the key sets do not match.
    """
    expected = hf_param_names(module)
    patterns = [re.compile(p) for p in ignore]
    missing = [n for n in expected if n not in state_dict]
    unexpected = [n for n in state_dict if n not in expected and not any(p.search(n) for p in patterns)]
    if missing or unexpected:
        raise ValueError(_key_error(missing, unexpected))
    with torch.no_grad():
        for hf_name, (ours, shard) in expected.items():
            prefix, _, param = ours.rpartition(".")
            owner = module.get_submodule(prefix)
            if shard is not None:
                owner.load_shard(shard, param, state_dict[hf_name])
            else:
                target = owner.hf_view(param) if hasattr(owner, "hf_view") else getattr(owner, param).data
                _checked_copy(target, state_dict[hf_name], hf_name)


def _key_error(missing: list[str], unexpected: list[str], show: int = 5) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing keys (e.g. {missing[:show]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[:show]})")
    return "checkpoint does not match the model: " + "; ".join(parts)
