"""DFlashSpeculator: turns committed target features + bonus tokens into K drafts per request.

One call = DFLASH.md "One decode step" steps 4-5: write the committed rows' context K/V into the
draft cache, then ONE batched block forward on [bonus, MASK x (B - 1)] per request at positions
P..P+B-1 (P = bonus position, B = the drafter's block_size), scored with the target's LM head at
slots 1..K, argmax. The block keeps its trained width B whatever K is (`full_block`): the drafter
was trained on whole blocks whose rows see each other, and a block cut to K + 1 rows drafts worse
(H200, batch 1, 32 HumanEval prompts, session 23: acceptance 2.23 -> 2.72 at K = 3, 2.47 -> 3.00 at
K = 7, docs/benchmarks/gpu.md "Session 23"); only the K drafts the target verifies are scored.
With a draft vocabulary (blockdraft.spec.draft_vocab.DraftHead, FR-Spec) the scoring uses only the
head rows of the N ranked ids and the argmax is mapped back to target ids; verification is
unchanged, so the output stays the target's.
Reference loop: z-lab `dflash/model.py` `dflash_generate` (its `block_size` argument = K + 1, so
it cuts the block for K < B - 1; we do not).
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from blockdraft.layers import fused_ops
from blockdraft.spec.dflash.draft_block import DraftBlock, build_draft_block
from blockdraft.spec.dflash.draft_model import DFlashDraftModel
from blockdraft.spec.draft_vocab import DraftHead


class DraftTarget(Protocol):
    """What the drafter borrows from the target model (blockdraft.models CausalLM)."""

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, H] token embeddings (embed_tokens, no extra scaling)."""
        ...

    def compute_logits(self, hidden: torch.Tensor, *, upcast: bool = True) -> torch.Tensor:
        """[N, H] -> [N, V] float32 through the target's LM head (upcast=False: may keep the
        head's dtype; the drafter passes it when it only takes the argmax). A target with
        `batch_invariant` True also takes invariant=False (the fast head for drafts)."""
        ...


class DFlashSpeculator:
    """DFlash drafting with a paged draft KV cache that shares the target's page ids.

    The draft cache has its own tensors (`kv_caches`, one per draft layer) but is indexed by the
    same `block_table` / `slot_mapping` as the target's cache, so the scheduler's page allocation
    covers both.

    Invariant: before `propose` for a request with bonus position P, every position < P of that
    request has had its features passed with a real slot exactly once (earlier calls or this one).
    """

    def __init__(
        self,
        drafter: DFlashDraftModel,
        target: DraftTarget,
        num_speculative_tokens: int | None,
        num_kv_blocks: int | None,
        kv_block_size: int,
        draft_head: DraftHead | None = None,
        full_block: bool = True,
    ) -> None:
        """
        Args:
            drafter: the loaded DFlashDraftModel, on the target's device; its config gives the
                block size, target layer ids and mask token. On CUDA its projections are stacked
                in place (DFlashDraftModel.stack_projections).
            target: the target model whose embeddings and LM head the drafter borrows (DraftTarget).
            num_speculative_tokens: K, 1 <= K <= block_size - 1 (None: block_size - 1).
            num_kv_blocks, kv_block_size: the target cache's page count and page size. None pages:
                allocate later with `allocate_kv_caches` (the GPU pool is sized after profiling).
            draft_head: score drafts over this draft vocabulary (its N ranked ids) instead of the
                target's full LM head; None = the full vocabulary.
            full_block: draft with the trained block of B = block_size rows whatever K is (True, the
                default), or with K + 1 rows (False, as z-lab's loop; see the module docstring).
        Raises:
            ValueError: K out of range; a draft head whose hidden size or ids do not fit the drafter.
        """
        k = drafter.config.block_size - 1 if num_speculative_tokens is None else num_speculative_tokens
        k = drafter.config.check_num_speculative_tokens(k)
        self.draft_head = _check_draft_head(draft_head, drafter)  # before touching the drafter
        if drafter.device.type == "cuda":  # one q/k/v and one gate/up matmul per draft layer
            drafter.stack_projections()
        self.drafter = drafter
        self.target = target
        self.num_speculative_tokens = k
        self.aux_layer_ids = drafter.config.target_layer_ids
        self.mask_token_id = drafter.config.mask_token_id
        self.kv_block_size = kv_block_size
        self.full_block = bool(full_block)
        self.kv_caches: list = []
        if num_kv_blocks is not None:
            self.allocate_kv_caches(num_kv_blocks)

    def allocate_kv_caches(self, num_kv_blocks: int) -> None:
        """(Re)allocate the draft caches with `num_kv_blocks` pages (the target pool's page count)."""
        self.kv_caches = []  # free the old tensors before allocating the new ones
        self.kv_caches = self.drafter.allocate_kv_caches(num_kv_blocks, self.kv_block_size)

    def kv_bytes_per_block(self) -> int:
        """Bytes one page costs across every draft layer (K and V), for sizing the shared pool."""
        cfg = self.drafter.config
        per_layer = 2 * self.kv_block_size * cfg.num_key_value_heads * cfg.head_dim
        return per_layer * len(self.drafter.layers) * self.drafter.dtype.itemsize

    @property
    def num_query_tokens(self) -> int:
        """Q = K + 1 rows per request that the target verifies: [anchor, K drafts]."""
        return self.num_speculative_tokens + 1

    @property
    def num_block_tokens(self) -> int:
        """Rows per request in the draft block, [anchor, MASK x (rows - 1)]: the drafter's
        block_size B with `full_block`, else Q = K + 1."""
        return self.drafter.config.block_size if self.full_block else self.num_query_tokens

    @torch.no_grad()
    def write_context(self, features: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write this step's committed rows' context K/V into the draft cache, without drafting
        (steps that decode without drafts, the runner's disable_by_batch_size): later proposals
        then see every position. Arguments as `propose`'s; PADDING_SLOT rows are not written."""
        self.drafter.write_context(features, positions, self.kv_caches, slot_mapping)

    @torch.no_grad()
    def propose(
        self,
        features: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        bonus_tokens: torch.Tensor,
        bonus_positions: torch.Tensor,
        block_table: torch.Tensor,
        block_layout: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Absorb this step's committed rows, then draft. Sync-free unless the drafter's backend
        needs host metadata (the torch reference).

        Args:
            features: [T, n*H] target features of this step's rows (aux_layer_ids order).
            positions: [T] int positions of those rows.
            slot_mapping: [T] int64 slots; PADDING_SLOT for rejected / padding rows (not written).
            bonus_tokens: [R] int64 anchor token per request (last committed token).
            bonus_positions: [R] int P per request; context = positions < P.
            block_table: [R, M] int32 page ids per request (the target's).
            block_layout: optional prebuilt (query_start_loc [R + 1] int32, row_req [R*B] int32) of
                the draft block (CUDA graphs pass static buffers with padding requests: empty
                query range, bonus position 0, rows -1); None builds the dense layout.
        Returns:
            [R, K] int64 greedy drafts (target token ids, also with a draft head); column k-1 is the
            token proposed for position P + k.
        """
        block = build_draft_block(bonus_tokens, bonus_positions, self.num_block_tokens, self.mask_token_id, block_layout)
        return self.propose_block(features, positions, slot_mapping, block, block_table)

    @torch.no_grad()
    def propose_block(
        self,
        features: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block: DraftBlock,
        block_table: torch.Tensor,
    ) -> torch.Tensor:
        """`propose` with the draft block laid out already (spec.dflash.draft_block: B =
        `num_block_tokens` rows per request) -> [R, K] int64 greedy drafts. Other arguments as
        `propose`'s."""
        self.write_context(features, positions, slot_mapping)
        if block.num_reqs == 0:  # a step of prefill chunks only: context, no drafts
            return torch.empty(0, self.num_speculative_tokens, dtype=torch.long, device=block.token_ids.device)
        logits = self.block_logits(block, block_table, upcast=False)
        flat = logits.reshape(-1, logits.shape[-1])  # [R*K, V]: one row-argmax launch pair on CUDA
        drafts = fused_ops.argmax(flat, self.drafter.fused_ops).view(logits.shape[:-1])
        if self.draft_head is not None:  # draft-vocab columns -> target ids: one gather, no sync
            drafts = self.draft_head.to_target_ids(drafts)
        return drafts

    @torch.no_grad()
    def draft_logits(
        self,
        bonus_tokens: torch.Tensor,
        bonus_positions: torch.Tensor,
        block_table: torch.Tensor,
        block_layout: tuple[torch.Tensor, torch.Tensor] | None = None,
        upcast: bool = True,
    ) -> torch.Tensor:
        """One batched block forward ([R*B] rows) over the cached context -> logits [R, K, V] float32
        of block slots 1..K (upcast=False: possibly the LM head's dtype, see
        DFlashDraftModel.compute_logits).

        With a draft head the last dimension is its N draft-vocabulary columns instead, in
        draft-vocab order (column j scores target token `draft_head.token_ids[j]`): [R, K, N].
        """
        block = build_draft_block(bonus_tokens, bonus_positions, self.num_block_tokens, self.mask_token_id, block_layout)
        return self.block_logits(block, block_table, upcast)

    @torch.no_grad()
    def block_logits(self, block: DraftBlock, block_table: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """`draft_logits` of a laid-out draft block (B = `num_block_tokens` rows per request).

        Raises:
            ValueError: the block has another number of rows per request.
        """
        num_reqs, q, k = block.num_reqs, self.num_block_tokens, self.num_speculative_tokens
        if block.num_block_tokens != q:
            raise ValueError(f"draft block has {block.num_block_tokens} rows per request, this drafter drafts {q}")
        embeds = self.target.embed(block.token_ids)
        scale = self.drafter.config.input_embedding_scale
        if scale != 1.0:
            embeds = embeds * scale
        host_lists = self.drafter.attention_backend.host_metadata
        meta = block.attention_metadata(block_table, self.kv_block_size, host_lists)
        hidden = self.drafter(embeds, block.positions, self.kv_caches, meta)  # [R*B, H]
        # Slot 0 (the anchor) predicts nothing (sample_from_anchor=false); slot j predicts P + j.
        drafts_hidden = hidden.view(num_reqs, q, -1)[:, 1 : k + 1].reshape(num_reqs * k, -1)
        if self.draft_head is not None:
            head = self.draft_head.logits  # model dtype
        else:  # the target's head: a float32 copy of [R*K, V] only when the caller needs it
            # drafts need no batch invariance: the fast head even when the target runs in that mode
            fast = {"invariant": False} if getattr(self.target, "batch_invariant", False) else {}
            head = functools.partial(self.target.compute_logits, upcast=upcast, **fast)
        logits = self.drafter.compute_logits(drafts_hidden, head, upcast)  # output_multiplier / softcapping
        return logits.view(num_reqs, k, -1)


def _check_draft_head(head: DraftHead | None, drafter: DFlashDraftModel) -> DraftHead | None:
    """Raise ValueError unless `head` (if any) fits the drafter's hidden size and vocabulary."""
    if head is None:
        return None
    cfg = drafter.config
    if head.weight.shape[1] != cfg.hidden_size:
        raise ValueError(f"draft head rows have hidden size {head.weight.shape[1]}, the drafter {cfg.hidden_size}")
    if int(head.token_ids.max()) >= cfg.vocab_size:
        raise ValueError(f"draft head holds id {int(head.token_ids.max())}, outside the vocabulary [0, {cfg.vocab_size})")
    return head

