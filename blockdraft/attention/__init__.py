"""Attention backends behind one interface (`AttentionMetadata` in, output rows out)."""

from blockdraft.attention.metadata import PADDING_SLOT, AttentionMetadata, build_metadata

__all__ = ["AttentionMetadata", "PADDING_SLOT", "build_metadata"]
