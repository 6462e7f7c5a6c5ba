"""--device / --gpu-memory-utilization / --enforce-eager on generate, serve and eval-drafter: defaults,
help and clear errors before any model is loaded."""

import pytest
import torch

from blockdraft.cli import _parser, main
from blockdraft.llm import resolve_device


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"], ["eval-drafter"]])
def test_flags_and_defaults(command):
    args = _parser().parse_args(command)
    assert (args.device, args.gpu_memory_utilization, args.enforce_eager) == ("auto", 0.9, False)
    args = _parser().parse_args(command + ["--device", "cuda", "--gpu-memory-utilization", "0.5", "--enforce-eager"])
    assert (args.device, args.gpu_memory_utilization, args.enforce_eager) == ("cuda", 0.5, True)


def test_serve_pool_defaults_to_sizing_from_memory():
    assert _parser().parse_args(["serve"]).num_kv_blocks is None


def test_bad_utilization_fails_at_start_naming_the_knob(capsys):
    assert main(["generate", "hi", "--device", "cpu", "--gpu-memory-utilization", "1.5", "--no-draft"]) == 2
    assert "gpu_memory_utilization (--gpu-memory-utilization) must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_device_resolution():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match=r"^device must be one of"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")


def test_auto_dtype_is_the_checkpoints_except_fp32_on_cuda():
    from blockdraft.model_loader import resolve_dtype as _resolve_dtype

    assert _resolve_dtype("auto", {"torch_dtype": "float32"}, "cpu") == torch.float32
    assert _resolve_dtype("auto", {"torch_dtype": "float32"}, "cuda") == torch.bfloat16
    assert _resolve_dtype("auto", {"dtype": "bfloat16"}, "cuda") == torch.bfloat16
    assert _resolve_dtype("auto", {"dtype": "float16"}, "cuda") == torch.float16
    assert _resolve_dtype("float32", {"dtype": "bfloat16"}, "cuda") == torch.float32
    with pytest.raises(ValueError, match=r"dtype must be one of \['auto', 'float32', 'bfloat16', 'float16'\], got 'fp8'"):
        _resolve_dtype("fp8", {}, "cpu")
