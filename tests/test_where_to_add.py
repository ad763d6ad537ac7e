"""Worked examples of docs/house.md's "where to add": each addition touches only the files that section names.

A precision is one row of PRECISION_TABLE (medusa_export/export/precisions.py); the rule for adding an acceptance
rule is shown in tests/test_acceptance.py, a family in tests/test_families_table.py (see docs/house.md).
"""

from __future__ import annotations

import dataclasses
import json

from conftest import make_tiny_medusa, tiny_loaded
from medusa_export.export import precisions
from medusa_export.pipeline import BuildConfig, build_artifact
from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.engines.ort import OrtEngine
from medusa_runtime.decode.loop import generate
from medusa_runtime.trees.tree import make_tree
from medusa_runtime.trees.treespec import tree_from_spec


def test_a_precision_is_one_table_row(tmp_path, monkeypatch):
    """int8 weights with fp32 activations (MatMulNBits accuracy level 1) as a new --precision: one row, nothing else."""
    row = dataclasses.replace(precisions.PRECISION_TABLE["int8"], name="int8-fp32act", accuracy_level=1)
    monkeypatch.setitem(precisions.PRECISION_TABLE, row.name, row)

    _, model = make_tiny_medusa(vocab=503, hidden=128, intermediate=512, medusa_heads=2, head_noise=0.3)
    out = build_artifact(tiny_loaded(model), tree_from_spec("8", num_heads=2), tmp_path / "art",
                         BuildConfig(precision=row.name, graph="contrib", new_tokens=16), progress=False)
    m = json.loads((out / "manifest.json").read_text())
    assert m["precision"]["name"] == "int8-fp32act" and m["flavour"] == "ort-contrib"
    assert m["validation"]["passed"] and m["validation"]["tolerance"]["reference"] == "vanilla"
    # The graph carries the row's accuracy level (1: fp32 activations), not int8's default (4).
    import onnx

    def levels(graph):
        return {a.i for n in onnx.load(str(out / graph), load_external_data=False).graph.node
                if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"}

    assert levels("model.onnx") == {1}
    assert levels("heads.onnx") == {4}  # the heads keep level 4 whatever the backbone's row says
    # Medusa equals plain greedy decoding of the same graph (the row's tolerance rule), checked here again.
    art = load_artifact(out)
    eng = OrtEngine(art)
    root = make_tree([], num_heads=2, topk=art.tree.topk)
    prompt = [5, 17, 230, 9]
    medusa = generate(eng, prompt, art.tree, max_new_tokens=24, max_context=256)
    plain = generate(eng, prompt, root, max_new_tokens=24, max_context=256)
    assert medusa.tokens == plain.tokens and len(medusa.tokens) == 24
    assert 1 + sum(medusa.step_tokens) == 24 and plain.step_tokens == [1] * 23
