"""CPU batch-1 decode step: our CausalLM vs HF forward with past_key_values, same random weights.

Run: python tests/models/_bench_decode.py [--dtype bfloat16] [--layers 24] [--context 128] [--steps 40]
Shape: Qwen2.5-0.5B (hidden 896, 14 heads, 2 KV heads, head_dim 64, ffn 4864, vocab 151936, tied).
Steps of both models are interleaved (this box may be shared) and the median / min are reported.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from blockdraft.attention.metadata import build_metadata
from blockdraft.config import ModelConfig
from blockdraft.models import allocate_kv_caches, build_model

QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_parameters=dict(rope_type="default", rope_theta=1e6),
    tie_word_embeddings=True,
)


class OursDecoder:
    def __init__(self, hf, config: ModelConfig, dtype: torch.dtype, prompt: torch.Tensor, bs: int = 16):
        self.model = build_model(config, dtype)
        self.model.load_weights(hf.state_dict())
        self.bs, self.table = bs, [list(range(64))]
        self.caches = allocate_kv_caches(config, 64, bs, dtype)
        n = len(prompt)
        self._run(prompt, torch.arange(n), build_metadata([n], [n], self.table, bs))
        self.pos = n

    def _run(self, ids, positions, meta):
        hidden, _ = self.model(ids, positions, self.caches, meta)
        return self.model.compute_logits(hidden[-1:])

    def step(self, token: int) -> torch.Tensor:
        meta = build_metadata([self.pos + 1], [1], self.table, self.bs)
        logits = self._run(torch.tensor([token]), torch.tensor([self.pos]), meta)
        self.pos += 1
        return logits


class HFDecoder:
    def __init__(self, hf, prompt: torch.Tensor):
        self.hf = hf
        out = hf(prompt[None], use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values

    def step(self, token: int) -> torch.Tensor:
        out = self.hf(torch.tensor([[token]]), past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        return out.logits[0, -1:].float()


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    hf_cfg = transformers.Qwen2Config(num_hidden_layers=args.layers, **QWEN25_05B)
    hf = transformers.Qwen2ForCausalLM(hf_cfg).to(dtype).eval()
    config = ModelConfig.from_hf_dict(hf_cfg.to_dict())
    prompt = torch.randint(0, hf_cfg.vocab_size, (args.context,))
    with torch.inference_mode():
        ours, ref = OursDecoder(hf, config, dtype, prompt), HFDecoder(hf, prompt)
        t_ours, t_hf = [], []
        for i in range(args.steps):
            token = int(prompt[i % len(prompt)])
            t_ours.append(timed(lambda: ours.step(token)))
            t_hf.append(timed(lambda: ref.step(token)))
    for name, ts in (("ours", t_ours[3:]), ("hf", t_hf[3:])):
        print(f"{name:5s} {args.dtype} threads={torch.get_num_threads()} decode step: median {statistics.median(ts):7.2f} ms  min {min(ts):7.2f} ms")
    print(f"speedup (median) {statistics.median(t_hf[3:]) / statistics.median(t_ours[3:]):.2f}x")


if __name__ == "__main__":
    main()
