from blockdraft.engine.kv_cache_manager import KVCacheManager
from blockdraft.engine.request import Request
from blockdraft.sampling_params import SamplingParams


def _req(n=3):
    return Request("r", list(range(n)), SamplingParams())


def test_allocate_grows_by_pages_and_free_returns_them():
    kv = KVCacheManager(num_blocks=4, kv_block_size=4)
    r = _req()
    assert kv.allocate_slots(r, 4) and len(r.block_ids) == 1
    assert kv.allocate_slots(r, 5) and len(r.block_ids) == 2
    assert kv.allocate_slots(r, 8) and len(r.block_ids) == 2
    assert kv.num_free_blocks == 2
    kv.free(r)
    assert kv.num_free_blocks == 4 and r.block_ids == []


def test_allocation_that_does_not_fit_allocates_nothing():
    kv = KVCacheManager(num_blocks=2, kv_block_size=4)
    a, b = _req(), _req()
    assert kv.allocate_slots(a, 5)
    assert not kv.allocate_slots(b, 5)
    assert b.block_ids == [] and kv.num_free_blocks == 0
    assert kv.usage() == 1.0
