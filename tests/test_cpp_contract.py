"""The C++ contract: cpp/medusa_plan.cpp, compiled here, prints the buffers a C++ driver binds at
each step; they must be medusa_runtime's (tree buffers, shapes, profiles, positions, masks,
greedy acceptance with its tie rule, KV compaction slots), for the shared tiny artifact and
for other trees (root only, chain, bushy, the 64-node default) over the same manifest.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import skip_or_fail_in_ci

from medusa_runtime.decode.acceptance import accept_greedy
from medusa_runtime.engines.kvcache import compaction_slots
from medusa_runtime.engines.trt_plan import PROFILE_ORDER, io_shapes, model_profiles, select_profile
from medusa_runtime.decode.loop import causal_mask
from medusa_runtime.trees.tree import make_tree, tree_from_json
from medusa_runtime.trees.treespec import tree_from_spec

SOURCE = Path(__file__).resolve().parents[1] / "cpp" / "medusa_plan.cpp"
JSON_HEADER = Path("/usr/include/nlohmann/json.hpp")


@pytest.fixture(scope="module")
def plan_binary(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None or not JSON_HEADER.is_file():
        skip_or_fail_in_ci("needs g++ and nlohmann-json3-dev (apt-get install g++ nlohmann-json3-dev; .ci/run does)")
    exe = tmp_path_factory.mktemp("cpp") / "medusa_plan"
    subprocess.run([gxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-o", str(exe), str(SOURCE)],
                   check=True, capture_output=True, text=True)
    return exe


def _run(exe, artifact, *args) -> dict:
    done = subprocess.run([str(exe), str(artifact), *map(str, args)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _with_tree(artifact: Path, tree, folder: Path) -> Path:
    """manifest.json + tree.json of ``artifact`` with another tree (all the C++ program reads)."""
    folder.mkdir()
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest["tree"].update(size=tree.size, depth=tree.max_depth, topk=tree.topk)
    manifest["graphs"]["model"]["profiles"]["tree_step"]["S"] = [tree.size, tree.size]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / manifest["files"]["tree"]).write_text(json.dumps(tree.to_json_with_buffers()))
    return folder


def _trees(heads: int):
    return {
        "root": make_tree([], num_heads=heads),
        "chain": tree_from_spec("chain", num_heads=heads),
        "bushy": make_tree([[i] for i in range(5)] + [[0, 1], [0, 0], [2, 0], [0, 0, 3]], num_heads=heads, topk=6),
        "64": tree_from_spec("64", num_heads=heads),
    }


def _check_plan(plan: dict, artifact: Path, prompt_len: int, past: int) -> None:
    manifest = json.loads((artifact / "manifest.json").read_text())
    tree = tree_from_json(json.loads((artifact / "tree.json").read_text()), num_heads=manifest["model"]["medusa_heads"])
    b = tree.buffers()
    graph = manifest["graphs"]["model"]
    profiles = model_profiles(manifest)
    for step, S, positions, mask in (
        ("prefill", prompt_len, past + np.arange(prompt_len), causal_mask(prompt_len)),
        ("tree_step", tree.size, past + b.depth, b.attention_mask),
    ):
        got = plan[step]
        sizes = {"S": S, "P": past}
        for kind in ("inputs", "outputs"):
            want = io_shapes(graph[kind], sizes)
            assert [t["name"] for t in got[kind]] == [t["name"] for t in graph[kind]]
            assert [t["dtype"] for t in got[kind]] == [t["dtype"] for t in graph[kind]]
            assert {t["name"]: tuple(t["shape"]) for t in got[kind]} == want
        assert got["profile"] == profiles[select_profile(profiles, sizes)].name
        assert got["position_ids"] == positions.tolist()
        assert np.array_equal(np.array(got["new_token_mask"], dtype=bool), mask)
    assert plan["tree_step"]["fits"] == (past + tree.size <= manifest["model"]["max_context"])
    assert {t["name"]: tuple(t["shape"]) for t in plan["heads"]["outputs"]} == \
        io_shapes(manifest["graphs"]["heads"]["outputs"], {"R": 1})
    t = plan["tree"]
    assert t["depth"] == b.depth.tolist() and t["parent"] == b.parent.tolist()
    assert t["candidate_index"] == b.candidate_index.tolist()
    assert t["retrieve_indices"] == b.retrieve_indices.tolist()
    assert t["flat_candidates"] == 1 + manifest["model"]["medusa_heads"] * tree.topk


def test_plan_of_the_artifact(plan_binary, tiny_trt_artifact):
    art = Path(tiny_trt_artifact)
    for prompt_len, past in ((7, 0), (1, 0), (3, 40), (1, 250)):
        _check_plan(_run(plan_binary, art, "--prompt-len", prompt_len, "--past", past), art, prompt_len, past)
    plan = _run(plan_binary, art, "--prompt-len", 5)
    assert PROFILE_ORDER.index(plan["prefill"]["profile"]) == 0
    assert plan["model"]["num_layers"] == json.loads((art / "manifest.json").read_text())["model"]["num_layers"]


def test_plan_for_other_trees(plan_binary, tiny_trt_artifact, tmp_path):
    heads = json.loads((Path(tiny_trt_artifact) / "manifest.json").read_text())["model"]["medusa_heads"]
    for name, tree in _trees(heads).items():
        folder = _with_tree(Path(tiny_trt_artifact), tree, tmp_path / name)
        _check_plan(_run(plan_binary, folder, "--prompt-len", 4, "--past", 9), folder, 4, 9)


def test_greedy_acceptance_and_compaction_match(plan_binary, tiny_trt_artifact, tmp_path):
    """Random node tokens/argmaxes (drawn from a small vocabulary so that paths are accepted,
    and often tie): the C++ accepted path, bonus token and KV copies are the runtime's."""
    heads = json.loads((Path(tiny_trt_artifact) / "manifest.json").read_text())["model"]["medusa_heads"]
    rng = np.random.default_rng(0)
    ties = 0
    for name, tree in _trees(heads).items():
        folder = _with_tree(Path(tiny_trt_artifact), tree, tmp_path / name)
        for case in range(12):
            tokens = rng.integers(0, 3, tree.size)
            argmax = rng.integers(0, 3, tree.size)
            past = int(rng.integers(0, 100))
            got = _run(plan_binary, folder, "--past", past, "--accept",
                       ",".join(map(str, tokens)), ",".join(map(str, argmax)))["accept"]
            want = accept_greedy(tree, tokens, argmax)
            assert got["accepted"] == want.accepted.tolist(), (name, case)
            assert (got["next_token"], got["path_index"]) == (want.next_token, want.path_index)
            assert got["emitted"] == [int(t) for t in tokens[want.accepted[1:]]] + [want.next_token]
            slots = compaction_slots(past, want.accepted, capacity=10**6)
            assert [(c["slot"], c["row"]) for c in got["kv_copies"]] == list(zip(slots.tolist(), want.accepted.tolist()))
            assert got["new_past"] == past + len(want.accepted)
            b = tree.buffers()
            ok = np.r_[False, argmax[b.parent[1:]] == tokens[1:]]
            lengths = [int(np.cumprod([ok[n] for n in row[1:] if n >= 0] or [0]).sum()) for row in b.retrieve_indices]
            ties += lengths.count(max(lengths)) > 1
    assert ties > 5  # the tie rule (first row wins) was exercised


def test_bad_input_is_an_error(plan_binary, tiny_trt_artifact, tmp_path):
    folder = _with_tree(Path(tiny_trt_artifact), tree_from_spec("chain", num_heads=3), tmp_path / "t")
    data = json.loads((folder / "tree.json").read_text())
    data["buffers"]["candidate_index"][1] += 1
    (folder / "tree.json").write_text(json.dumps(data))
    done = subprocess.run([str(plan_binary), str(folder)], capture_output=True, text=True)
    assert done.returncode == 1 and "candidate_index" in done.stderr
    done = subprocess.run([str(plan_binary), str(tiny_trt_artifact), "--prompt-len", "999"], capture_output=True, text=True)
    assert done.returncode == 1 and "no optimization profile" in done.stderr
    batched = tmp_path / "batched"  # a batched step graph (docs/batching.md) is refused by name
    shutil.copytree(tiny_trt_artifact, batched)
    manifest = json.loads((batched / "manifest.json").read_text())
    (batched / "manifest.json").write_text(json.dumps({**manifest, "batch": {"version": 1, "max_batch_size": 4}}))
    done = subprocess.run([str(plan_binary), str(batched)], capture_output=True, text=True)
    assert done.returncode == 1 and "build with --batch-size 1" in done.stderr
