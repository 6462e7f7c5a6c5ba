"""CPU batch-1 step: our CausalLM vs HF forward with past_key_values, same random weights.

Run: python tests/models/_bench_decode.py [--dtype bfloat16] [--rows 1] [--context 128] [--steps 40]
Shape: Qwen2.5-0.5B (hidden 896, 14 heads, 2 KV heads, head_dim 64, ffn 4864, vocab 151936, tied).
`--rows 1` is a decode step; `--rows 16` a DFlash-verify-sized step (16 new tokens on the same
context each time; logits for all rows, as verify needs them). Steps of both models are
interleaved (this box may be shared) and the median / min are reported. On a box shared with
other busy processes, OpenMP's default spin-waiting makes every multi-threaded number noisy;
compare with --threads 1 or OMP_WAIT_POLICY=PASSIVE.
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


class OursStepper:
    """Prefills `prompt`, then each step runs `rows` new tokens at the next positions."""

    def __init__(self, hf, config: ModelConfig, dtype: torch.dtype, prompt: torch.Tensor, rows: int, bs: int = 16):
        self.model = build_model(config, dtype)
        self.model.load_weights(hf.state_dict())
        n, self.rows, self.bs = len(prompt), rows, bs
        self.table = [list(range(-(-(n + rows) // bs)))]
        self.caches = allocate_kv_caches(config, len(self.table[0]), bs, dtype)
        self.model(prompt, torch.arange(n), self.caches, build_metadata([n], [n], self.table, bs))
        self.pos = n

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        # Same positions every step (like a rejected verify): the cache slots are overwritten.
        meta = build_metadata([self.pos + self.rows], [self.rows], self.table, self.bs)
        positions = torch.arange(self.pos, self.pos + self.rows)
        hidden, _ = self.model(tokens, positions, self.caches, meta)
        return self.model.compute_logits(hidden)


class HFStepper:
    def __init__(self, hf, prompt: torch.Tensor, rows: int):
        self.hf, self.n, self.rows = hf, len(prompt), rows
        self.cache = hf(prompt[None], use_cache=True, logits_to_keep=1).past_key_values

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.hf(tokens[None], past_key_values=self.cache, use_cache=True, logits_to_keep=self.rows)
        self.cache.crop(-self.rows)  # roll back, so every step sees the same context length
        return out.logits[0].float()


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rows", type=int, default=1)
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
    tokens = torch.randint(0, hf_cfg.vocab_size, (args.rows,))
    with torch.inference_mode():
        ours, ref = OursStepper(hf, config, dtype, prompt, args.rows), HFStepper(hf, prompt, args.rows)
        diff = (ours.step(tokens) - ref.step(tokens)).abs().max().item()
        t_ours, t_hf = [], []
        for _ in range(args.steps):
            t_ours.append(timed(lambda: ours.step(tokens)))
            t_hf.append(timed(lambda: ref.step(tokens)))
        diff = max(diff, (ours.step(tokens) - ref.step(tokens)).abs().max().item())  # rollback kept them in sync
    label = f"{args.dtype} rows={args.rows} ctx={args.context} threads={torch.get_num_threads()}"
    for name, ts in (("ours", t_ours[3:]), ("hf", t_hf[3:])):
        print(f"{name:5s} {label}: median {statistics.median(ts):7.2f} ms  min {min(ts):7.2f} ms")
    speedup = statistics.median(t_hf[3:]) / statistics.median(t_ours[3:])
    print(f"speedup (median) {speedup:.2f}x   max |logit diff| {diff:.2e}")


if __name__ == "__main__":
    main()
