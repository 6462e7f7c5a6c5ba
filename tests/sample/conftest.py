import pytest
import torch


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """These tests run many small ops; on an oversubscribed CPU, intra-op threads only add barrier waits."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
