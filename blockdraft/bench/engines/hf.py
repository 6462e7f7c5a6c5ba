"""transformers `generate` as a baseline: greedy, batched with left padding, default cache."""

from __future__ import annotations

import torch

from blockdraft.bench.engines import PLAIN, Generation


class HFEngine:
    """Batched greedy `model.generate` of a transformers *ForCausalLM.

    The model's own generation config is replaced by a clean greedy one (Qwen checkpoints ship
    repetition_penalty / sampling defaults that would change the tokens), with no EOS, so every
    request decodes exactly `max_tokens` tokens.

    Args:
        model: the HF model (on the benchmark device).
        pad_token_id: id used for left padding (masked out; any valid id works).
    """

    engine, mode = "hf", PLAIN

    def __init__(self, model, pad_token_id: int = 0) -> None:
        from transformers import GenerationConfig

        self.model = model
        self.pad_token_id = int(pad_token_id)
        model.generation_config = GenerationConfig(
            do_sample=False, pad_token_id=self.pad_token_id, eos_token_id=None, bos_token_id=None
        )

    def unsupported(self, batch_size: int) -> str | None:
        return None

    def generate(self, prompts: list[list[int]], max_tokens: int, concurrency: int | None = None) -> Generation:
        """One `generate` call per batch of `concurrency` prompts (all prompts when None), in order:
        static batching, as HF users batch; num_steps = max_tokens per batch (one forward per token)."""
        size = concurrency or len(prompts)
        new, steps = [], 0
        for i in range(0, len(prompts), size):
            ids, mask = left_pad(prompts[i : i + size], self.pad_token_id, self.model.device)
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens)
            new += out[:, ids.shape[1] :].tolist()
            steps += max_tokens
        return Generation(token_ids=new, num_steps=steps)


def left_pad(prompts: list[list[int]], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id lists -> (input_ids, attention_mask), both [N, max_len] int64, padded on the left.

    Raises:
        ValueError: no prompts, or an empty prompt.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("left_pad needs at least one prompt and no empty prompt")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)
