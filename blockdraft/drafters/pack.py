"""8-bit storage of a shipped drafter: per-output-channel symmetric int8 for 2-D weights.

Only how the shipped bytes are stored changes: `unpack` rebuilds a bf16 state dict with the z-lab
names, which is written as a standard z-lab folder and loaded like any other drafter. Speculation
stays lossless whatever the drafter's weights; quantization can only change acceptance (issue 4
allows it if the acceptance length stays within 2% of the bf16 drafter's).

Pack file `PACK_FILE` (safetensors; the name avoids the `*.safetensors` pattern so `load_drafter`
never mistakes it for plain weights): for each 2-D weight W [out, in], `NAME` int8 [out, in] and
`NAME.scale` float32 [out] with W ~= NAME * scale[:, None]; every other tensor `NAME` as bf16.
"""

from __future__ import annotations

import torch

PACK_FILE = "model.int8"
_SCALE = ".scale"


def pack(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """z-lab state dict -> int8 pack (scale = max |W[row]| / 127, round to nearest, clamp +-127)."""
    out = {}
    for name, w in state.items():
        w = w.detach().float().cpu()
        if w.dim() == 2:
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            out[name] = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
            out[name + _SCALE] = scale.contiguous()
        else:
            out[name] = w.to(torch.bfloat16).contiguous()
    return out


def unpack(packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """int8 pack -> bf16 z-lab state dict.

    Raises:
        ValueError: an int8 tensor without its scale, or a scale whose length is not the row count.
    """
    out = {}
    for name, t in packed.items():
        if name.endswith(_SCALE):
            continue
        if t.dtype == torch.int8:
            scale = packed.get(name + _SCALE)
            if scale is None or scale.shape != (t.shape[0],):
                raise ValueError(f"int8 drafter pack: tensor {name!r} has no matching {name + _SCALE!r}")
            out[name] = (t.float() * scale.float()[:, None]).to(torch.bfloat16)
        else:
            out[name] = t.to(torch.bfloat16)
    return out
