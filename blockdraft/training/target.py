"""The frozen target as the trainer sees it: features at target_layer_ids, embeddings, LM head.

Two implementations of one small protocol:
- `EngineTarget`: our `CausalLM` (blockdraft.models), one ragged causal prefill through the paged
  reference attention. The default, and the CPU path (the same code the engine runs).
- `HFTarget`: a transformers `AutoModelForCausalLM` on the same converted weights. The documented
  fast path for the GPU run (our GPU path is eager today); features are HF `hidden_states[i + 1]`,
  which is exactly what DFLASH.md defines (tests/training/test_target.py checks they agree).
Feature id i = OUTPUT of decoder layer i (DFLASH.md "Draft model").
"""

from __future__ import annotations

from typing import Protocol

import torch


class TrainTarget(Protocol):
    """What the trainer borrows from the target; all weights frozen."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int

    def features(self, input_ids: torch.Tensor, lengths: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
        """input_ids [b, T] (right-padded), lengths [b] -> [b, T, n*H] (no grad; padding rows arbitrary)."""
        ...

    def features_and_greedy(self, input_ids: torch.Tensor, lengths: torch.Tensor,
                            layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`features`, and greedy [b, T] int64: the target's argmax next token after each position
        (greedy[:, p] is what greedy decoding would put at p + 1; padding rows arbitrary)."""
        ...

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 -> [..., H] token embeddings (no grad)."""
        ...

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V]; differentiable w.r.t. `hidden`."""
        ...

    def lm_head_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [N] int64 -> [N, H] LM-head rows (tied models: embedding rows), model dtype."""
        ...


# rows of logits per argmax in greedy_ids: [2048, 152K] is 0.6 GB in bf16, 1.2 GB in float32
GREEDY_CHUNK_ROWS = 2048


def greedy_ids(lm_head, hidden: torch.Tensor) -> torch.Tensor:
    """Argmax of `lm_head(rows)` for every row of `hidden` [N, H] -> [N] int64 (ties: the lowest id,
    as the engine's greedy sampling), GREEDY_CHUNK_ROWS rows at a time."""
    out = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
    for lo in range(0, hidden.shape[0], GREEDY_CHUNK_ROWS):
        out[lo : lo + GREEDY_CHUNK_ROWS] = lm_head(hidden[lo : lo + GREEDY_CHUNK_ROWS]).argmax(-1)
    return out


class EngineTarget:
    """Our CausalLM (`blockdraft.model_loader.load_target(...).model`) as a TrainTarget."""

    def __init__(self, model, kv_block_size: int = 16) -> None:
        cfg = model.config
        self.model = model
        self.hidden_size, self.num_hidden_layers, self.vocab_size = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
        self.kv_block_size = kv_block_size

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, lengths: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
        """One ragged prefill of all sequences (paged caches sized for this batch only)."""
        return self._prefill(input_ids, lengths, layer_ids, greedy=False)[0]

    @torch.no_grad()
    def features_and_greedy(self, input_ids: torch.Tensor, lengths: torch.Tensor,
                            layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`features` and the argmax of the LM head at every position (TrainTarget)."""
        return self._prefill(input_ids, lengths, layer_ids, greedy=True)

    def _prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, layer_ids: tuple[int, ...],
                 greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        from blockdraft.attention.metadata import build_metadata
        from blockdraft.models import allocate_kv_caches

        lens = [int(n) for n in lengths]
        bs = self.kv_block_size
        tables, start = [], 0
        for n in lens:
            pages = (n + bs - 1) // bs
            tables.append(list(range(start, start + pages)))
            start += pages
        dev = input_ids.device
        caches = allocate_kv_caches(self.model.config, max(start, 1), bs, self._dtype(), dev)
        meta = build_metadata(lens, lens, tables, bs, device=dev)
        ids = torch.cat([input_ids[i, :n] for i, n in enumerate(lens)])
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        hidden, aux = self.model(ids, pos, caches, meta, aux_layer_ids=tuple(layer_ids))
        out = aux.new_zeros(input_ids.shape[0], input_ids.shape[1], aux.shape[-1])
        for i, chunk in enumerate(aux.split(lens)):
            out[i, : lens[i]] = chunk
        if not greedy:
            return out, None
        best = torch.zeros(input_ids.shape, dtype=torch.long, device=dev)
        for i, chunk in enumerate(greedy_ids(lambda h: self.model.compute_logits(h, upcast=False), hidden).split(lens)):
            best[i, : lens[i]] = chunk
        return out, best

    def _dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(ids.reshape(-1)).view(*ids.shape, -1)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden.to(self._dtype()))

    def lm_head_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head_rows(token_ids)


class HFTarget:
    """A transformers causal LM (e.g. `AutoModelForCausalLM.from_pretrained(folder)`) as a TrainTarget."""

    def __init__(self, model) -> None:
        cfg = model.config
        self.model = model
        self.hidden_size, self.num_hidden_layers, self.vocab_size = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, lengths: torch.Tensor, layer_ids: tuple[int, ...]) -> torch.Tensor:
        """Right padding needs no attention mask: pad rows come after every real row (causal).

        Raises:
            ValueError: a layer id >= L - 1 (HF's last hidden state is after the final norm).
        """
        return self.features_and_greedy(input_ids, lengths, layer_ids, greedy=False)[0]

    @torch.no_grad()
    def features_and_greedy(self, input_ids: torch.Tensor, lengths: torch.Tensor, layer_ids: tuple[int, ...],
                            greedy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`features` and the argmax of the LM head over the final-normed last hidden state at
        every position (TrainTarget; greedy=False: None instead).

        Raises:
            ValueError: a layer id >= L - 1 (as `features`).
        """
        if max(layer_ids) >= self.num_hidden_layers - 1:
            raise ValueError(f"layer ids {layer_ids}: HF features support ids < {self.num_hidden_layers - 1}")
        out = self.model.model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
        if not greedy:
            return feats, None
        last = out.last_hidden_state
        best = greedy_ids(self.model.get_output_embeddings(), last.reshape(-1, last.shape[-1]))
        return feats, best.view(last.shape[:2])

    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.get_output_embeddings()
        return head(hidden.to(head.weight.dtype))

    @torch.no_grad()
    def lm_head_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        weight = self.model.get_output_embeddings().weight
        return weight.index_select(0, token_ids.to(weight.device)).clone()
