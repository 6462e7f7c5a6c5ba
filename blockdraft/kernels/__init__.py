"""Triton kernels for the CUDA path of the per-layer elementwise / normalisation ops.

Each kernel fuses what the torch code in `blockdraft.layers` does in several launches, with the
same rounding order (fp32 math, results rounded to the input dtype where the torch code rounds),
so a kernel and its torch twin agree bit for bit or within an ulp in bf16. The dispatch between
the two (CUDA tensors -> kernel, everything else -> the unchanged torch code) lives in
`blockdraft.layers.fused_ops`; these modules import triton and are only imported on first use.

Modules (each self-contained, so a test can load a fresh copy under TRITON_INTERPRET=1):
    rms_norm: `rms_norm`, `fused_add_rms_norm`.
    rope: `qk_norm_rope` (optional per-head RMSNorm, then rotate-half RoPE, q and k in one launch;
        optionally writing k and v into the paged KV cache in the same launch).
    activation: `silu_and_mul`, `silu_mul`.
    skinny_gemm: `skinny_linear` (x @ W.T for 1-16 rows; with `up=`, a SwiGLU down projection in
        one launch) and `config_for` / `fuses_swiglu`, the measured choices between it and cuBLAS
        (dispatched from `blockdraft.layers.fused_ops.linear` / `silu_mul_linear`).
"""
