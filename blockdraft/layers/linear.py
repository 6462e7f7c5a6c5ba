"""Linear layers: stacked projections, optional oneDNN weight packing on CPU, HF-name loading.

Stacking: q/k/v (and gate/up) live in one matrix so a layer runs one matmul instead of three;
`StackedLinear.shard_rows` records which output rows each HF projection fills.

CPU packing: `torch.ops.mkldnn._reorder_linear_weight` stores a weight in oneDNN's blocked
layout once, after loading, and `_linear_pointwise` multiplies with it (what Inductor's CPU
weight freezing does). Measured on the 2-core AMD EPYC dev box, Qwen2.5-0.5B shapes, 24 layers:
bf16 decode (1 row) 80 -> 45 ms and 16 rows 124 -> 71 ms vs `F.linear`; fp32 1 row ~110 -> ~90 ms,
16 rows ~200 -> ~140 ms. Packed weights are inference-only and replace the dense ones.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from blockdraft.layers.fused_ops import UsesFusedOps, linear

# Row count oneDNN picks the blocked weight format for. 16 = a DFlash verify block; decode (1 row)
# is within a few % of a 1-row format, while 16-row matmuls are ~1.5x faster in fp32 than with it.
_PACK_ROWS_HINT = 16
# Fewer rows than this are zero-padded up to it (see packed_linear). Any count >= 2 gives
# row-count-independent results; 4 also decodes fastest on the 2-core dev box (bf16 Qwen 0.5B,
# 32 greedy tokens, process CPU time, medians of 6 interleaved runs: 1 row unpadded 3.59 s,
# padded to 2 rows 4.05 s, to 3 rows 3.49 s, to 4 rows 3.22 s).
_MIN_ROWS = 4


def cpu_packing_supported(dtype: torch.dtype, device: str | torch.device) -> bool:
    """True when weights of `dtype` on `device` can be packed for oneDNN (CPU, fp32 / bf16; bf16
    only where the CPU has oneDNN's bf16 path: AVX512-BW/VL/DQ, AVX-NE-CONVERT or AMX; an
    AVX2-only CPU refuses to pack bf16 weights)."""
    return (
        torch.device(device).type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (dtype == torch.float32 or cpu_has_fast_bf16())
    )


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bf16 matmuls natively through oneDNN (False on AVX2-only CPUs, where
    bf16 weights are converted on every multiply and fp32 is the fast dtype)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(probe()) if probe is not None else False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Dense [out, in] CPU weight -> opaque oneDNN-layout copy for `packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ W.T + bias with W from `pack_weight`; no autograd.

    Each output row depends only on its input row, not on how many rows share the call (inputs of
    fewer than 4 rows are zero-padded, see _MIN_ROWS).
    Raises:
        RuntimeError: x requires grad (packed weights are for inference only).
    """
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("packed CPU weights are inference-only; build the model with pack_weights=False to train")
    rows = x.shape[0] if x.dim() == 2 else _MIN_ROWS
    if rows < _MIN_ROWS:
        # Batch invariance: for one row oneDNN takes a GEMV path whose reduction order differs from
        # its GEMM path (last-bit differences, e.g. on [1, 4864] x [4864, 896]); zero rows keep a
        # decode row on the GEMM path, so it equals the same row inside a DFlash verify block
        # (K + 1 rows) bit for bit, and greedy speculation stays lossless.
        pad = x.new_zeros(_MIN_ROWS - rows, x.shape[1])
        return torch.ops.mkldnn._linear_pointwise(torch.cat([x, pad]), packed, bias, "none", [], "")[:rows]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(UsesFusedOps, nn.Module):
    """y = x @ W.T + b, W [out, in] (HF layout). Input [rows, in] -> [rows, out], params' dtype.

    Parameters are left uninitialised (weights are always loaded). After `pack_()` the dense
    `weight` is dropped (set to None) and `packed_weight` is used instead. On CUDA, 1-16 rows of
    half precision take the skinny-GEMM kernel where it measured faster than cuBLAS
    (`blockdraft.layers.fused_ops.linear`; `fused_ops = False` keeps cuBLAS); in batch-invariant
    mode (`batch_invariant`, `set_batch_invariant`) every row count takes one fixed-tile kernel.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias)
        return linear(x, self.weight, self.bias, self.fused_ops, self.batch_invariant)

    def pack_(self) -> None:
        """Replace the dense weight by a oneDNN-packed copy (CPU, fp32 / bf16; see module doc)."""
        self.packed_weight = pack_weight(self.weight)
        self.weight = None

    def extra_repr(self) -> str:
        packed = ", packed" if self.packed_weight is not None else ""
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{packed}"


class StackedLinear(Linear):
    """Linear whose output features are the concatenation of named HF projections (shards).

    Args:
        in_features: input size.
        shards: ordered (hf_name, out_features) pairs, e.g. [("q_proj", 896), ("k_proj", 128), ...].
        bias: whether every shard carries a bias.
    """

    def __init__(self, in_features: int, shards: list[tuple[str, int]], bias: bool = False) -> None:
        super().__init__(in_features, sum(size for _, size in shards), bias=bias)
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
        _checked_copy(getattr(self, param).data[lo:hi], tensor, f"{shard}.{param}")


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
    """Copy an HF-named state dict into `module` (stacked layers included), all or nothing.

    Args:
        module: the model (not packed); its parameter names mirror HF except stacked layers.
        state_dict: HF names -> tensors (any float dtype; cast on copy).
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
            owner = module.get_submodule(prefix) if prefix else module
            if shard is None:
                _checked_copy(getattr(owner, param).data, state_dict[hf_name], hf_name)
            else:
                owner.load_shard(shard, param, state_dict[hf_name])


def _key_error(missing: list[str], unexpected: list[str], show: int = 5) -> str:
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing keys (e.g. {missing[:show]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys (e.g. {unexpected[:show]})")
    return "checkpoint does not match the model: " + "; ".join(parts)
