import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """Test tensors and models are tiny: intra-op threads only add overhead, and on a busy 2-core
    machine spinning threads made small ops ~40x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
