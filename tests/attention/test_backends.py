"""Backend selection: one place, the device's default, clear errors."""

import pytest
import torch

from blockdraft.attention.backends import select_attention_backend
from blockdraft.attention.dense_ref import paged_attention_dense
from blockdraft.attention.torch_ref import paged_attention


def test_cpu_defaults_to_the_torch_reference_with_host_metadata():
    spec = select_attention_backend("cpu")
    assert spec.name == "torch" and spec.attention is paged_attention and spec.host_metadata


def test_dense_twin_is_sync_free_on_any_device():
    spec = select_attention_backend(torch.device("cpu"), "dense")
    assert spec.attention is paged_attention_dense and not spec.host_metadata


def test_bad_names_and_triton_off_cuda_are_refused():
    with pytest.raises(ValueError, match="attention backend must be one of"):
        select_attention_backend("cpu", "flash")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        select_attention_backend("cpu", "triton")
