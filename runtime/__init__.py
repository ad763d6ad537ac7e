"""medusa_runtime: the torch-free side of medusa-export.

Imports only numpy at import time; onnxruntime, tokenizers and jinja2 when an artifact is
opened (tensorrt only for its backend). The pure pieces here (tree buffers, acceptance,
KV compaction, stops) are the single source of truth: the PyTorch reference decode loop
in ``medusa_export`` uses them too.

    from medusa_runtime import MedusaSession
    session = MedusaSession("artifacts/smollm2-135m-t16-fp32", threads=2)
    print(session.generate("Name three colors.", max_new_tokens=64).text)
"""

from .errors import (ArtifactError, BackendUnavailableError, ChatTemplateError, ContextOverflowError,
                     InvalidTreeError, MedusaError)
from .contract.manifest import Manifest
from .front.session import Completion, MedusaSession
from .trees.tree import Tree, TreeBuffers, make_tree
from .trees.treespec import tree_from_spec

__all__ = [
    "ArtifactError",
    "BackendUnavailableError",
    "ChatTemplateError",
    "Completion",
    "ContextOverflowError",
    "InvalidTreeError",
    "Manifest",
    "MedusaError",
    "MedusaSession",
    "Tree",
    "TreeBuffers",
    "make_tree",
    "tree_from_spec",
]
