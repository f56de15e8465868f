import pytest
import torch

# First, before any test module imports transformers: run from a clone's root (`python -m pytest`),
# the source tree's top-level kernels/ folder would shadow the `kernels` distribution transformers
# imports; importing specgraph binds the installed one (see specgraph/__init__.py).
import specgraph  # noqa: F401,E402


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """Test tensors and models are tiny: intra-op threads only add overhead, and on a busy 2-core
    machine spinning threads made small ops ~40x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
