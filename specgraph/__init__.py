"""specgraph: lossless speculative decoding for HuggingFace causal LMs."""
import os as _os

# Spinning OpenMP workers make every compiled step many times slower on a shared CPU; only takes
# effect if torch was not imported yet, and an explicit user setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from specgraph import perfmodel
from specgraph.compiler import SpecGraphModel, compile
from specgraph.onnx_export import export_onnx
from specgraph.planner import Plan, plan
from specgraph.trees import TreeSpec, ancestor_mask, tree_from_paths, tree_positions
from specgraph.verify import verify_chain, verify_tree
from specgraph.warping import SamplingParams, is_greedy, warp_logits, warped_probs

__version__ = "0.1.0"

__all__ = [
    "compile", "SpecGraphModel", "export_onnx", "verify_chain", "verify_tree", "warp_logits", "warped_probs", "is_greedy", "SamplingParams",
    "TreeSpec", "ancestor_mask", "tree_from_paths", "tree_positions", "perfmodel", "plan", "Plan", "__version__",
]
