"""Profile our engine's decode steps on CUDA (plain vs DFlash) with random weights of a real shape.

    python scripts/profile_step.py --shape qwen2.5-0.5b --tokens 32 --out $OUT/prof
Prints the top CUDA kernels and CPU ops per step and how many graph replays ran.
"""
import argparse
import json

import torch

from blockdraft.bench.workload import random_workload
from blockdraft.llm import LLM
from blockdraft.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen2.5-0.5b")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--out", default="/tmp/prof")
    a = p.parse_args()
    w = random_workload(a.shape, torch.device("cuda"), torch.bfloat16, num_prompts=a.batch, prompt_len=128,
                        draft_layers=None, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True)
    for mode in ("plain", "dflash"):
        llm = _llm(w, mode)
        llm.generate(w.prompts, params)  # warm-up (captures graphs, compiles kernels)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            outs = llm.generate(w.prompts, params)
            torch.cuda.synchronize()
        steps = sum(o.num_steps for o in outs) if hasattr(outs[0], "num_steps") else None
        ka = prof.key_averages()
        print(f"===== {mode}: steps={steps}")
        print(ka.table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))
        print(ka.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=70))
        prof.export_chrome_trace(f"{a.out}_{mode}.json")


def _llm(w, mode):
    if mode == "plain":
        return LLM(target=w.target, device="cuda", num_kv_blocks=2048)
    from blockdraft.spec.dflash.speculator import DFlashSpeculator

    spec = DFlashSpeculator(w.drafter, w.target.model, 15, 2048, 16)
    return LLM(target=w.target, device="cuda", num_kv_blocks=2048, speculator=spec)


if __name__ == "__main__":
    main()
