"""DFlash block-diffusion drafter: config, draft model, checkpoint io, speculator (DFLASH.md)."""

from blockdraft.spec.dflash.checkpoint import export_drafter, load_drafter, random_drafter, random_drafter_config
from blockdraft.spec.dflash.config import DFlashConfig, build_target_layer_ids
from blockdraft.spec.dflash.draft_model import DFlashDraftModel
from blockdraft.spec.dflash.speculator import DFlashSpeculator

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashSpeculator",
    "build_target_layer_ids",
    "export_drafter",
    "load_drafter",
    "random_drafter",
    "random_drafter_config",
]
