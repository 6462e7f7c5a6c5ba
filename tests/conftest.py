"""Shared fixtures: tiny random targets with a real (word-level) tokenizer, and engine builders."""

from __future__ import annotations

import os

import pytest
import torch

from blockdraft.config import ModelConfig
from blockdraft.cpu_threads import THREADS_ENV
from blockdraft.llm import LLM, LoadedTarget

# CLI calls and engines (LLM(threads=None)) inside the tests keep torch's thread count: without it they
# would pick their own from the machine's load (cpu_threads), and runs compared within a test could
# differ in fp32.
os.environ.setdefault(THREADS_ENV, str(torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist with several workers, skip the `gpu_exclusive` tests: parallel workers
    share one GPU, so their pool sizes and sync counts depend on what the others hold."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) <= 1:
        return
    skip = pytest.mark.skip(reason="needs the GPU to itself: run `python -m pytest -q -m gpu_exclusive tests/gpu` "
                                   "without -n")  # fmt: skip
    for item in items:
        if item.get_closest_marker("gpu_exclusive"):
            item.add_marker(skip)


EOS_ID = 0
VOCAB = 96


def word(i: int) -> str:
    """Text of token i in the test tokenizer; no word occurs inside another, so stop strings are exact."""
    return f"w{i:02d}x"


def make_tokenizer(vocab_size: int = VOCAB):
    """A real fast tokenizer: token i is the word `word(i)` (0 is "<eos>"); text joins words with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": EOS_ID, **{word(i): i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def make_ascii_tokenizer():
    """A real fast byte-level BPE tokenizer of VOCAB ids that llguidance reads (structured outputs):
    0 is "<eos>", token i in 1..95 is the printable ASCII character chr(31 + i) (space to "~"), no
    merges, so any printable text tokenizes character by character and texts are exact."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char_of = bytes_to_unicode()  # GPT-2's byte -> vocabulary character map
    tok = Tokenizer(models.BPE({"<eos>": EOS_ID, **{char_of[31 + i]: i for i in range(1, VOCAB)}}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_config(arch: str = "llama", **over) -> ModelConfig:
    base = dict(
        arch=arch, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=False, attention_bias=arch == "qwen2",
        qk_norm=arch == "qwen3", eos_token_ids=(EOS_ID,),
    )
    base.update(over)
    return ModelConfig(**base)


def tiny_target(arch: str = "llama", seed: int = 0, logit_scale: float = 4.0, **over) -> LoadedTarget:
    """A random tiny target in fp32. `logit_scale` sharpens the LM head so outputs are not flat."""
    from blockdraft.models import build_model

    config = tiny_config(arch, **over)
    torch.manual_seed(seed)
    model = build_model(config, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():  # build_model leaves weights uninitialised
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.08 if p.dim() >= 2 else 0.02)
        model.lm_head.weight.mul_(logit_scale) if hasattr(model, "lm_head") else None
    model.eval()
    return LoadedTarget(config, model, make_tokenizer(config.vocab_size), "<tiny>")


def make_llm(target: LoadedTarget, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("kv_block_size", 4)
    return LLM(target=target, **kw)


def random_prompts(n: int, seed: int = 0, low: int = 3, high: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(1, VOCAB, (L,), generator=g).tolist() for L in lens]


@pytest.fixture(scope="session")
def llama_target() -> LoadedTarget:
    return tiny_target("llama")
