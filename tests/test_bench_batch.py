"""scripts/bench_batch.py on a tiny batched artifact: one run prints looped and batched side by side at each
batch size, and every batched reply is token-identical to the looped one (the script exits 1 otherwise)."""

import importlib.util
import json
import sys
from pathlib import Path

from conftest import make_tiny_medusa, tiny_loaded

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "bench_batch.py"
_spec = importlib.util.spec_from_file_location("bench_batch", _PATH)
bb = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_batch", bb)
_spec.loader.exec_module(bb)


def test_bench_batch_side_by_side(tmp_path, capsys):
    from medusa_export.export.build import build_artifact
    from medusa_export.export.config import BuildConfig
    from medusa_runtime.tree import tree_from_spec

    lm = tiny_loaded(make_tiny_medusa()[1], max_context=256)
    art = build_artifact(lm, tree_from_spec("16", num_heads=3), tmp_path / "b4", BuildConfig(validate=False, batch_size=4),
                         progress=False)
    out = tmp_path / "bench.json"
    assert bb.main(["--batched-artifact", str(art), "--prompts", "3", "--max-new-tokens", "6", "--threads", "1",
                    "--batch-sizes", "1,2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 2] and all(r["identical"] for r in rows)
    assert [r["batched"]["max_batch_seen"] for r in rows] == [1, 2]
    assert all(r[m]["tokens_per_s"] > 0 for r in rows for m in ("looped", "batched"))
    table = capsys.readouterr().out.splitlines()
    assert "looped tok/s" in table[1] and "batched tok/s" in table[1] and len(table) == 4
