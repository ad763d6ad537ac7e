"""medusa_runtime: the torch-free side of medusa-export.

Imports only numpy (plus onnxruntime, tokenizers and jinja2 in the engine loop).
The pure pieces here (tree buffers, acceptance, KV compaction, stops) are the single
source of truth: the PyTorch reference decode loop in ``medusa_export`` uses them too.
"""

from .errors import ArtifactError, ContextOverflowError, InvalidTreeError, MedusaError
from .tree import Tree, TreeBuffers, make_tree, tree_from_spec

__all__ = [
    "ArtifactError",
    "ContextOverflowError",
    "InvalidTreeError",
    "MedusaError",
    "Tree",
    "TreeBuffers",
    "make_tree",
    "tree_from_spec",
]
