"""build_runner on CPU: the unchanged default (torch backend, no graphs), and clear refusals."""

import pytest

from blockdraft.config import CacheConfig, SchedulerConfig
from blockdraft.runner.setup import build_runner
from tests.conftest import tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=5)


def _build(target, cache=CacheConfig(4, 64), **kw):
    return build_runner(target.model, target.config, None, cache, SchedulerConfig(), "cpu", **kw)


def test_cpu_default_is_the_reference_backend_without_graphs(target):
    setup = _build(target)
    assert setup.runner.attention_backend.name == "torch" and setup.runner.graphs is None
    assert setup.num_kv_blocks == 64 and setup.max_model_len == 64 * 4
    eager = _build(target, attention_backend="dense", graph_mode="eager")
    assert eager.runner.graphs.target.buckets[-1] == 64 and eager.runner.graphs.draft is None


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(graph_mode="capture", attention_backend="dense"), "needs a CUDA device"),
        (dict(graph_mode="eager"), "backend without host metadata"),
        (dict(graph_mode="always"), "graph_mode must be one of"),
        (dict(cache=CacheConfig(4, None)), "num_kv_blocks must be given on cpu"),
        (dict(attention_backend="triton"), "needs a CUDA device"),
    ],
)
def test_refusals_name_the_setting(target, kw, match):
    _build(target)  # the reference backend
    with pytest.raises(ValueError, match=match):
        _build(target, **kw)
    assert target.model.model.layers[0].self_attn.backend.__name__ == "paged_attention"  # untouched


def test_a_kv_pool_the_memory_cannot_hold_is_one_error_naming_its_size(target):
    with pytest.raises(ValueError, match=r"the KV pool of 10000000000 pages x 4 tokens \(\d+\.\d GiB\) does not fit "
                                         r"in cpu memory: lower num_kv_blocks \(--num-kv-blocks\)"):
        _build(target, cache=CacheConfig(4, 10**10))
