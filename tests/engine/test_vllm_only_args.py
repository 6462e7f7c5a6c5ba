"""vLLM's LLM(...) arguments that blockdraft has no parameter for: accepted at the values that
change nothing (a vLLM script's tensor_parallel_size=1 runs), refused otherwise with what to do
instead; an unknown argument is refused naming the nearest known one."""

import pytest

from blockdraft.sampling_params import SamplingParams
from blockdraft.vllm_only_args import VLLM_ONLY
from tests.conftest import make_llm


def test_neutral_vllm_arguments_are_accepted_and_change_nothing(llama_target):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = make_llm(llama_target).generate([[5, 6, 7]], params)[0].token_ids
    ported = make_llm(llama_target, tensor_parallel_size=1, trust_remote_code=False, speculative_config=None,
                      disable_log_stats=True, swap_space=8, quantization=None)
    assert ported.generate([[5, 6, 7]], params)[0].token_ids == plain


@pytest.mark.parametrize("kw, words", [
    (dict(speculative_config={"method": "dflash", "num_speculative_tokens": 3}), "draft=PATH"),
    (dict(tensor_parallel_size=2), "one device"),
    (dict(trust_remote_code=True), "never runs a model's own code"),
    (dict(download_dir="/tmp/x"), "cache_dir="),
    (dict(tensor_parallel_size=True), "only as 1"),  # a bool is not the count 1
])
def test_other_values_are_refused_with_what_to_do_instead(llama_target, kw, words):
    with pytest.raises(TypeError, match="vLLM's") as e:
        make_llm(llama_target, **kw)
    assert words in str(e.value) and repr(next(iter(kw.values()))) in str(e.value)


def test_an_unknown_argument_names_the_nearest_known_one(llama_target):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'max_modle_len'; did you mean max_model_len\?"):
        make_llm(llama_target, max_modle_len=64)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'frobnicate'$"):
        make_llm(llama_target, frobnicate=1)


def test_every_entry_says_what_to_do_unless_any_value_is_fine():
    for name, (neutral, instead) in VLLM_ONLY.items():
        assert neutral is None or neutral, name
        assert instead or neutral is None or len(neutral) == 2, name  # only "any value" / both bools need no hint


def test_dtype_as_a_torch_dtype_is_taken_as_its_name(tmp_path):
    """LLM(dtype=torch.bfloat16), as vLLM takes it (a trial found only strings accepted)."""
    import torch

    from blockdraft.llm import LLM
    from tests.server.tiny_model import write_tiny_model

    model = str(write_tiny_model(tmp_path / "model"))
    for dtype, want in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), ("float", torch.float32),
                        ("half", torch.float16)):  # vLLM's aliases too
        llm = LLM(model=model, dtype=dtype)
        assert {p.dtype for p in llm.target.model.parameters() if p.is_floating_point()} == {want}
    with pytest.raises(ValueError, match=r"^dtype must be one of \['auto', 'float32', 'bfloat16', 'float16'\], "
                                         r"got torch.int8"):
        LLM(model=model, dtype=torch.int8)
