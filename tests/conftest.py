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


@pytest.fixture(scope="session")
def char_tokenizer():
    """A factory of character-level tokenizers: ids 3.. are the printable ASCII characters (all <
    128), no chat template; for tiny models saved as HF folders."""
    def make():
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        for i in range(32, 127):
            vocab[chr(i)] = len(vocab)
        tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
        tk.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")

    return make


@pytest.fixture(scope="module")
def smollm2():
    """(model, tokenizer) of the default model, or a skip where it is not installed."""
    pytest.importorskip("gguf")
    from specgraph.models import load_model

    try:
        return load_model("default")
    except (ImportError, FileNotFoundError) as e:
        pytest.skip(f"default model not installed: {e}")


@pytest.fixture(autouse=True)
def _lazy_graphs(monkeypatch):
    """specgraph.compile builds its whole graph set up front by default; a test builds only the
    graphs it runs (the same graphs, on first use). tests/test_graphset.py checks the default."""
    from specgraph import compiler

    monkeypatch.setattr(compiler, "WARMUP_BY_DEFAULT", False)


@pytest.fixture(autouse=True, scope="session")
def _graph_cache_in_tmp(tmp_path_factory):
    """Graph cache entries written by tests go to a temporary folder, never the user's cache."""
    import os

    old = os.environ.get("SPECGRAPH_GRAPH_CACHE")
    os.environ["SPECGRAPH_GRAPH_CACHE"] = str(tmp_path_factory.mktemp("graph_cache"))
    yield
    if old is None:
        os.environ.pop("SPECGRAPH_GRAPH_CACHE", None)
    else:
        os.environ["SPECGRAPH_GRAPH_CACHE"] = old
