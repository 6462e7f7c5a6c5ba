"""Per-layer elementwise / normalisation ops with two implementations and one dispatch rule.

Each op has a torch twin (`*_ref`), which is the code every layer ran before the kernels existed
and still runs on CPU, and a Triton kernel (`blockdraft.kernels`) that does the same work in one
launch with the same rounding order (bf16 results agree bit for bit or within an ulp). The
exception is `linear`: its twin is `F.linear` (cuBLAS), and the skinny-GEMM kernel sums in
another order, so they agree within half-precision rounding only. Decoding small batches on a
GPU is launch-bound: the kernels cut a decoder layer from ~40 launches to ~10.

Dispatch (`use_kernels`): the kernel runs when the calling module allows it (`fused_ops`, see
`UsesFusedOps`), the input is a CUDA tensor and no autograd graph is being recorded through the
op (the kernels have no backward). Ops whose kernel needs one dtype also take the twin for mixed
dtypes (autocast: bf16 activations, fp32 weights). Everything else, CPU in particular, runs the
twin unchanged.
"""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from blockdraft.layers.rotary import apply_rotary

TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


class UsesFusedOps:
    """Mixin for modules with a kernel path. `fused_ops = False` forces the torch twins.

    Defaults to True when triton is importable; switch a whole model with `set_fused_ops`.
    `batch_invariant = True` (`set_batch_invariant`) makes the module's CUDA matmuls and attention
    give each row the same bits whatever the batch around it (slower; off by default).
    """

    fused_ops: bool = TRITON_AVAILABLE
    batch_invariant: bool = False


def set_fused_ops(model: nn.Module, enabled: bool) -> nn.Module:
    """Allow (True) or forbid (False) the Triton kernels in every submodule of `model`; returns it.

    Raises:
        RuntimeError: enabled=True but triton is not installed.
    """
    return _set_on_modules(model, "fused_ops", enabled, "fused ops")


def set_batch_invariant(model: nn.Module, enabled: bool) -> nn.Module:
    """Batch-invariant CUDA numerics for every submodule of `model` (True) or the fast kernels
    (False); returns it. On: every linear layer and the LM head take
    `blockdraft.kernels.invariant_gemm` (fixed tiles for any row count) and causal attention the
    single-row kernel with a fixed KV split (`paged_attention_triton(batch_invariant=True)`), so a
    token's logits do not depend on how many rows shared its step: greedy speculative decoding then
    equals plain decoding token for token, and a request's output does not depend on what else was
    in flight (vLLM's VLLM_BATCH_INVARIANT, SGLang's --enable-deterministic-inference). The flag
    switches CUDA kernels only (the engine refuses the mode on the CPU:
    blockdraft.runner.setup.check_batch_invariant).

    Raises:
        RuntimeError: enabled=True but triton is not installed.
    """
    return _set_on_modules(model, "batch_invariant", enabled, "batch-invariant kernels")


def _set_on_modules(model: nn.Module, attr: str, enabled: bool, what: str) -> nn.Module:
    """Set `attr` on every UsesFusedOps submodule; refuse turning on Triton-backed `what` without triton."""
    if enabled and not TRITON_AVAILABLE:
        raise RuntimeError(f"{what} need triton, which is not installed (pip install triton)")
    for module in model.modules():
        if isinstance(module, UsesFusedOps):
            setattr(module, attr, enabled)
    return model


# Tests set this to run the kernels (under TRITON_INTERPRET=1) on CPU tensors too.
_CPU_KERNELS = False


def _needs_autograd(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _one_dtype(*tensors: torch.Tensor | None) -> bool:
    """All given tensors share a dtype (mixed dtypes, e.g. under autocast, take the twin)."""
    dtype = tensors[0].dtype
    return all(t is None or t.dtype == dtype for t in tensors)


def use_kernels(enabled: bool, *tensors: torch.Tensor | None) -> bool:
    """True when `enabled`, tensors[0] is a CUDA tensor and no tensor needs autograd."""
    x = tensors[0]
    return enabled and (x.is_cuda or _CPU_KERNELS) and not _needs_autograd(*tensors)


_KERNELS: SimpleNamespace | None = None


def _kernels() -> SimpleNamespace:
    """The kernel functions, imported on first use (CPU-only runs never import triton)."""
    global _KERNELS
    if _KERNELS is None:
        from blockdraft.kernels import activation, argmax, invariant_gemm, rms_norm, rope, skinny_gemm

        _KERNELS = SimpleNamespace(
            rms_norm=rms_norm.rms_norm, fused_add_rms_norm=rms_norm.fused_add_rms_norm,
            qk_norm_rope=rope.qk_norm_rope, norm_rope=rope.norm_rope,
            silu_and_mul=activation.silu_and_mul, silu_mul=activation.silu_mul,
            skinny_config_for=skinny_gemm.config_for, skinny_linear=skinny_gemm.skinny_linear,
            skinny_fuses_swiglu=skinny_gemm.fuses_swiglu, skinny_swiglu=skinny_gemm.skinny_swiglu,
            skinny_swiglu_config_for=skinny_gemm.swiglu_config_for, argmax_rows=argmax.argmax_rows,
            invariant_linear=invariant_gemm.invariant_linear,
        )  # fmt: skip
    return _KERNELS


# ---- torch twins (the CPU path, and the oracle the kernels are tested against) ----


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> x / sqrt(mean(x^2) + eps) * weight, dtype promote(x, weight) (HF's rounding)."""
    # F.rms_norm = x * rsqrt(mean(x^2) + eps) in one call (fewer ops than spelling it out).
    # HF normalises in fp32, rounds to the input dtype, then scales: fusing the weight is
    # bit-identical only in fp32, so other dtypes keep HF's order.
    shape = (x.shape[-1],)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, shape, weight, eps)
    return weight * F.rms_norm(x.float(), shape, eps=eps).to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_ref(x + residual), x + residual); x, residual [..., N] of one dtype."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (when weights are given), then RoPE; shapes as `qk_norm_rope`."""
    if q_weight is not None:
        q, k = rms_norm_ref(q, q_weight, eps), rms_norm_ref(k, k_weight, eps)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def norm_rope_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Single-tensor `qk_norm_rope_ref` (e.g. DFlash context keys)."""
    return apply_rotary(x if weight is None else rms_norm_ref(x, weight, eps), cos, sin)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, [rows, I] each."""
    return F.silu(gate) * up


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * I] (gate first) -> silu(gate) * up [rows, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- dispatchers: the kernel when `use_kernels(fused, ...)` holds (spelled out: CPU calls pay
# one attribute read), else the twin ----


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool = True) -> torch.Tensor:
    """RMSNorm over the last dim. x [..., N], weight [N] -> [..., N] in promote(x, weight).

    fused: allow the Triton kernel (taken only for CUDA inputs without autograd).
    """
    if fused and (x.is_cuda or _CPU_KERNELS) and not _needs_autograd(x, weight):
        return _kernels().rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual = x + residual; returns (rms_norm(residual), residual). x, residual [..., N], one dtype.

    The new residual is bit-identical between kernel and twin (one rounded add); the inputs
    are not modified. fused: allow the Triton kernel.
    """
    if fused and (x.is_cuda or _CPU_KERNELS) and x.dtype == residual.dtype and not _needs_autograd(x, residual, weight):
        return _kernels().fused_add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optional per-head RMSNorm, then RoPE, of q [rows, heads, D] and k [rows, kv_heads, D].

    q / k may be strided views of a fused qkv output; cos / sin [rows, 1, D]; weights [D] or
    None (both or neither). Returns rotated (q, k) in the inputs' dtype. fused: allow the kernel
    (one launch for both; then all inputs must share one dtype, see blockdraft.kernels.rope).
    """
    kernel_ok = _one_dtype(q, k, cos, sin, q_weight, k_weight) and not _needs_autograd(q, k, q_weight, k_weight)
    if fused and (q.is_cuda or _CPU_KERNELS) and kernel_ok:
        return _kernels().qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps)
    return qk_norm_rope_ref(q, k, cos, sin, q_weight, k_weight, eps)


def qk_norm_rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`qk_norm_rope`, and where its kernel runs, the paged-cache write of (rotated k, v) in the
    same launch (`blockdraft.kernels.rope.qk_norm_rope(kv_write=...)`).

    Args:
        v [rows, kv_heads, D] like k; kv_cache (k_cache, v_cache) [num_blocks, kv_block_size,
        kv_heads, D]; slot_mapping [rows] (< 0: no write); the rest as `qk_norm_rope`.
    Returns:
        (q, k, written): written is True when the cache now holds this forward's K/V (the
        attention backend must then not write them again: `kv_written=True`), False when the
        torch twins ran and the backend writes as usual.
    """
    kernel_ok = (_one_dtype(q, k, v, cos, sin, q_weight, k_weight)
                 and not _needs_autograd(q, k, v, q_weight, k_weight))  # fmt: skip
    if fused and (q.is_cuda or _CPU_KERNELS) and kernel_ok:
        kv_write = (v, kv_cache[0], kv_cache[1], slot_mapping)
        q, k = _kernels().qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, kv_write=kv_write)
        return q, k, True
    q, k = qk_norm_rope_ref(q, k, cos, sin, q_weight, k_weight, eps)
    return q, k, False


def norm_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weight: torch.Tensor | None, eps: float, fused: bool = True
) -> torch.Tensor:
    """`qk_norm_rope` for one tensor x [rows, heads, D] -> [rows, heads, D]."""
    if fused and (x.is_cuda or _CPU_KERNELS) and _one_dtype(x, cos, sin, weight) and not _needs_autograd(x, weight):
        return _kernels().norm_rope(x, cos, sin, weight, eps)
    return norm_rope_ref(x, cos, sin, weight, eps)


def norm_rope_write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    fused: bool = True,
) -> tuple[torch.Tensor, bool]:
    """`norm_rope` of k, and where its kernel runs, the paged-cache write of (rotated k, v) in the
    same launch (the DFlash drafter's context rows). Arguments as `qk_norm_rope_write_kv`'s.

    Returns:
        (k, written): written is True when the cache now holds (k, v); False when the torch twin
        ran (or the cache's dtype or slot_mapping's device differ from k's) and the caller writes.
    """
    if (fused and (k.is_cuda or _CPU_KERNELS) and _one_dtype(k, v, cos, sin, weight, kv_cache[0], kv_cache[1])
            and slot_mapping.device == k.device and not _needs_autograd(k, v, weight)):  # fmt: skip
        return _kernels().norm_rope(k, cos, sin, weight, eps, kv_write=(v, kv_cache[0], kv_cache[1], slot_mapping)), True
    return norm_rope(k, cos, sin, weight, eps, fused), False


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fused: bool = True, invariant: bool = False
) -> torch.Tensor:
    """x [rows, in] @ weight [out, in].T + bias [out] -> [rows, out] in x's dtype.

    invariant (batch-invariant mode, `set_batch_invariant`): `invariant_gemm.invariant_linear`
    for a CUDA x of float16 / bfloat16 / float32 under the other conditions below, whatever the
    row count and `fused` (each row's bits then depend on that row alone); a CUDA x outside
    them raises ValueError (naming what fails) rather than fall back to cuBLAS. Otherwise the
    skinny-GEMM kernel when `fused`, x is a CUDA tensor of 1-16 float16 / bfloat16 rows (unit
    column stride; weight and bias contiguous, same dtype), nothing needs autograd, autocast is
    off and `blockdraft.kernels.skinny_gemm.config_for` has tiles for the shape (it measured faster
    than cuBLAS there); else `F.linear`, whose errors (shape mismatches) it raises. The kernel
    agrees with F.linear within half-precision rounding (another summation order).
    """
    if invariant and (x.is_cuda or _CPU_KERNELS):
        if not _skinny_eligible(True, x, weight, bias, any_dtype=True):  # no silent fallback to cuBLAS
            raise ValueError(
                f"batch-invariant linear needs a 2-D float16 / bfloat16 / float32 x with unit column stride, a "
                f"contiguous weight and bias of x's dtype, autocast off and no autograd; got x {tuple(x.shape)} "
                f"{x.dtype} strides {x.stride()}, weight {weight.dtype} (contiguous: {weight.is_contiguous()}), "
                f"autocast {torch.is_autocast_enabled(x.device.type)}, grad {_needs_autograd(x, weight, bias)}")
        return _kernels().invariant_linear(x, weight, bias)
    config = _skinny_config(fused, x, weight, bias)
    if config is not None:
        return _kernels().skinny_linear(x, weight, bias, config)
    return F.linear(x, weight, bias)


def silu_mul_linear(
    gate: torch.Tensor,
    up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fused: bool = True,
    invariant: bool = False,
) -> torch.Tensor:
    """SwiGLU's down projection: linear(silu_mul(gate, up), weight, bias) for gate / up [rows, in].

    Where `linear` would take the skinny-GEMM kernel and one launch measured faster for these
    rows and this shape (`skinny_gemm.fuses_swiglu`), that launch reads gate and up and forms
    silu(gate) * up on the fly, rounded as the activation kernel rounds it, so the result equals
    the two-launch path bit for bit; else the two ops as `silu_mul` and `linear` dispatch them
    (always so when `invariant`).
    """
    if (fused and not invariant and gate.shape == up.shape and gate.dtype == up.dtype and up.stride(-1) == 1
            and not _needs_autograd(up) and (gate.is_cuda or _CPU_KERNELS) and gate.dim() == 2
            and _kernels().skinny_fuses_swiglu(gate.shape[0], weight.shape[1], weight.shape[0])):  # fmt: skip
        config = _skinny_config(fused, gate, weight, bias)
        if config is not None:
            return _kernels().skinny_linear(gate, weight, bias, config, up=up)
    return linear(silu_mul(gate, up, fused), weight, bias, fused, invariant)


def swiglu_mlp(
    x: torch.Tensor,
    gate_up_weight: torch.Tensor,
    down_weight: torch.Tensor,
    fused: bool = True,
    invariant: bool = False,
) -> torch.Tensor:
    """SwiGLU feed-forward without biases: down(silu(x @ W_gate.T) * (x @ W_up.T)).

    x [rows, H]; gate_up_weight [2I, H] (gate rows first); down_weight [H_out, I] -> [rows, H_out].
    Launches, where the kernels run (`fused` and `linear`'s conditions):
      2-16 rows of a shape `skinny_gemm.swiglu_config_for` lists: the gate/up projection and the
          activation in one launch (`skinny_swiglu`), then the down projection;
      otherwise the gate_up GEMM, then `silu_mul_linear` (one row of some shapes: the activation
          inside the down projection's launch; else the activation kernel and the GEMM).
    Where they do not (CPU, float32 on cuBLAS, autograd), the torch twins, as `linear` / `silu_mul`.
    invariant: both projections as `linear(..., invariant=True)`, the activation kernel between them.
    """
    if not invariant and _skinny_eligible(fused, x, gate_up_weight, None):
        swiglu = _kernels().skinny_swiglu_config_for(x.shape[0], gate_up_weight.shape[1], gate_up_weight.shape[0],
                                                     x.device)  # fmt: skip
        if swiglu is not None:
            return linear(_kernels().skinny_swiglu(x, gate_up_weight, swiglu), down_weight, None, fused)
    gate, up = linear(x, gate_up_weight, None, fused, invariant).chunk(2, dim=-1)
    return silu_mul_linear(gate, up, down_weight, None, fused, invariant)


def _skinny_config(fused: bool, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The skinny-GEMM tiles for x @ weight.T + bias when `linear`'s conditions hold, else None."""
    if _skinny_eligible(fused, x, weight, bias):
        return _kernels().skinny_config_for(x.shape[0], weight.shape[1], weight.shape[0], x.device)
    return None


def _skinny_eligible(
    fused: bool, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, any_dtype: bool = False
) -> bool:
    """`linear`'s conditions for the skinny kernels, shape tables aside (see `linear`); any_dtype
    also admits float32 (the batch-invariant kernel)."""
    return bool(
        fused
        and (x.is_cuda or _CPU_KERNELS)
        and x.dim() == 2
        and (x.dtype in (torch.float16, torch.bfloat16) or (any_dtype and x.dtype == torch.float32))
        and _one_dtype(x, weight, bias)
        and x.stride(1) == 1
        and weight.is_contiguous()
        and (bias is None or bias.is_contiguous())
        and not torch.is_autocast_enabled(x.device.type)
        and not _needs_autograd(x, weight, bias)
    )


def silu_and_mul(gate_up: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """SwiGLU activation: gate_up [rows, 2 * I] (gate first) -> silu(gate) * up [rows, I]."""
    if fused and (gate_up.is_cuda or _CPU_KERNELS) and not _needs_autograd(gate_up):
        return _kernels().silu_and_mul(gate_up)
    return silu_and_mul_ref(gate_up)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """silu(gate) * up for separate gate / up [rows, I] (DFlash drafter MLP)."""
    if fused and (gate.is_cuda or _CPU_KERNELS) and gate.dtype == up.dtype and not _needs_autograd(gate, up):
        return _kernels().silu_mul(gate, up)
    return silu_mul_ref(gate, up)


def argmax(x: torch.Tensor, fused: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy ids: x [N, V] float logits -> [N] int64 (into `out` when given), == torch.argmax(x, -1)
    (ties: lowest id). On CUDA with `fused`, the two-launch kernel (blockdraft.kernels.argmax);
    other dtypes / layouts, CPU and autograd take torch.argmax, on the CPU over a float32 copy of
    bf16 / fp16 logits (exact, so the same ids: torch's CPU argmax over half types runs ~5x slower
    than the copy and a float32 argmax, 1.5 vs 0.3 ms for [5, 151936] on 2 cores)."""
    if (use_kernels(fused, x) and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1
            and x.dtype in (torch.float32, torch.float16, torch.bfloat16)):  # fmt: skip
        return _kernels().argmax_rows(x, out)
    if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    if out is None:
        return torch.argmax(x, dim=-1)
    return torch.argmax(x, dim=-1, out=out)
