"""specgraph: lossless speculative decoding for HuggingFace causal LMs."""
import os as _os

# Spinning OpenMP workers make every compiled step many times slower on a shared CPU; only takes
# effect if torch was not imported yet, and an explicit user setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _import_installed_kernels() -> None:
    """Import the ``kernels`` distribution (which transformers imports) before anything else can.

    The source tree keeps its Triton kernels in a top-level ``kernels/`` folder (shipped as
    ``specgraph.kernels``). Run from a clone's root (``python -m specgraph.cli``, ``python -m
    pytest``), that folder is on ``sys.path`` ahead of site-packages and would shadow the
    distribution, breaking ``transformers`` on its first model load."""
    import importlib.util
    import sys
    from pathlib import Path

    spec = None if "kernels" in sys.modules else importlib.util.find_spec("kernels")
    tree = Path(__file__).resolve().parent.parent
    if spec is None or spec.origin != str(tree / "kernels" / "__init__.py"):
        return  # already the distribution (or no clone on the path)
    saved = sys.path[:]
    sys.path[:] = [e for e in sys.path if Path(e or ".").resolve() != tree]
    try:
        import kernels  # noqa: F401 - cached in sys.modules for transformers
    except ImportError:
        pass  # not installed: transformers does not import it either
    finally:
        sys.path[:] = saved


_import_installed_kernels()

from specgraph import perfmodel
from specgraph.api import compile, prepare_settings
from specgraph.compiler import SpecGraphModel
from specgraph.onnx_export import export_onnx
from specgraph.planner import Plan, plan
from specgraph.precision import WEIGHTS, quantize
from specgraph.trees import TreeSpec, ancestor_mask, tree_from_paths, tree_positions
from specgraph.verify import verify_chain, verify_tree
from specgraph.warping import SamplingParams, is_greedy, warp_logits, warped_probs

__version__ = "0.1.0"

__all__ = [
    "compile", "prepare_settings", "SpecGraphModel", "export_onnx", "verify_chain", "verify_tree", "warp_logits", "warped_probs", "is_greedy", "SamplingParams",
    "TreeSpec", "ancestor_mask", "tree_from_paths", "tree_positions", "perfmodel", "plan", "Plan", "__version__",
    "quantize", "WEIGHTS",
]
