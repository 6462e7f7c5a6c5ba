"""`LLM(...)` and `SamplingParams(...)` keyword arguments that vLLM's take and blockdraft's do not.

Scripts ported from vLLM pass them; a bare "unexpected keyword argument" would not say what to do.
Each is accepted at the value that changes nothing here (vLLM's defaults: one device, no remote
code, ...) and refused otherwise with what blockdraft does instead; anything else unknown is
refused naming the nearest known arguments.
"""

from __future__ import annotations

import difflib

_NONE = (None,)
# name -> (values accepted because they change nothing here, what to do instead)
VLLM_ONLY: dict[str, tuple[tuple, str]] = {
    "speculative_config": (_NONE, "give the DFlash drafter as draft=PATH | \"shipped\" | \"auto\" and K as "
                                  "num_speculative_tokens=K"),
    "tensor_parallel_size": ((1,), "blockdraft runs a model on one device"),
    "pipeline_parallel_size": ((1,), "blockdraft runs a model on one device"),
    "data_parallel_size": ((1,), "blockdraft runs a model on one device; start one LLM per device"),
    "trust_remote_code": ((False,), "blockdraft never runs a model's own code: its architectures are built in"),
    "tokenizer": (_NONE, "the tokenizer is the model folder's (or the GGUF's)"),
    "tokenizer_mode": (("auto",), "the tokenizer is the model folder's (or the GGUF's), loaded by transformers"),
    "skip_tokenizer_init": ((False,), "the tokenizer is always loaded (prompts may still be token ids)"),
    "download_dir": (_NONE, "use cache_dir= (the catalog models' cache)"),
    "revision": (_NONE, "no model hub here: give a catalog name, a local HF folder or a .gguf file"),
    "tokenizer_revision": (_NONE, "no model hub here: give a catalog name, a local HF folder or a .gguf file"),
    "code_revision": (_NONE, "no model hub here: give a catalog name, a local HF folder or a .gguf file"),
    "hf_token": (_NONE, "no model hub here: give a catalog name, a local HF folder or a .gguf file"),
    "quantization": (_NONE, "weights run in dtype= (GGUF files are dequantized when they load)"),
    "kv_cache_dtype": (("auto",), "the KV cache is kept in the model's dtype"),
    "disable_log_stats": ((True, False), ""),  # blockdraft logs no periodic stats either way
    "swap_space": (None, ""),  # any number: preempted requests are recomputed, never swapped
    "cpu_offload_gb": ((0,), "the weights stay on the device"),
    "max_seq_len_to_capture": (None, ""),  # any: graphs are captured per batch bucket
}


# SamplingParams' (its init-only arguments); best_of equal to n is neutral too (SamplingParams says so)
SAMPLING_VLLM_ONLY: dict[str, tuple[tuple, str]] = {
    "guided_decoding": (_NONE, "use structured_outputs=StructuredOutputsParams(...) (the name newer vLLM uses "
                               "for it)"),
    "best_of": ((None, 1), "not supported: n=N returns N completions"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "logits_processors": ((None, []), "custom logits processors are not supported; logit_bias, allowed_token_ids, "
                                      "bad_words, min_tokens and the penalties cover the usual cases"),
    "output_kind": (_NONE, "LLM.generate returns finished outputs; LLM.generate_stream yields the text as it grows"),
    "extra_args": ((None, {}), "not supported: every field blockdraft reads is a SamplingParams argument"),
}


def check_vllm_only(kwargs: dict, known, table: dict = VLLM_ONLY, owner: str = "LLM") -> None:
    """Accept `kwargs` (arguments `owner`, "LLM" or "SamplingParams", has no parameter for) that
    `table` (VLLM_ONLY, SAMPLING_VLLM_ONLY) holds at a neutral value; `known`: the owner's own
    parameter names (for a typo's suggestion).

    Raises:
        TypeError: an argument not in `table` (naming the closest of `known`), or one at a value
            that would change something (naming what to do instead), as Python's own "unexpected
            keyword argument" would, with the way out.
    """
    for name, value in kwargs.items():
        if name not in table:
            near = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(near)}?" if near else ""
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}{hint}")
        neutral, instead = table[name]
        if neutral is not None and not any(value == n and type(value) is type(n) for n in neutral):
            allowed = " or ".join(repr(n) for n in neutral)
            raise TypeError(f"{owner}() takes vLLM's {name} only as {allowed} (it changes nothing here), got "
                            f"{value!r:.80}: {instead}")
