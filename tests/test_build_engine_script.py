"""engines/build_engine.sh (medusa_export.trt.commands.build_script) when trtexec fails: it prints the end of
trtexec's log and names the log (it printed "building model (fp16) ..." and exited 1, nothing else)."""

from __future__ import annotations

import json
import shutil
import subprocess

from medusa_export.trt.commands import LOG_TAIL_LINES, write_commands


def test_build_script_prints_trtexecs_error_and_names_its_log(tiny_trt_artifact, tmp_path):
    """It printed "building model (fp16) ..." and exited 1, the error only in a log it did not name."""
    art = shutil.copytree(tiny_trt_artifact, tmp_path / "art")
    write_commands(art, json.loads((art / "manifest.json").read_text()), "fp32")  # the own graph (fp16 first needs its typed graph)
    stub = tmp_path / "trtexec"
    stub.write_text("#!/usr/bin/env bash\nfor i in $(seq 1 40); do echo \"[I] line $i\"; done\n"
                    "echo '[E] Error[4]: [network.cpp::validate::3000] IShuffleLayer /Reshape: reshape changes volume'\n"
                    "echo '[E] Engine could not be created from network'\nexit 7\n")
    stub.chmod(0o755)
    r = subprocess.run(["bash", str(art / "engines/build_engine.sh"), "fp32"], env={"PATH": "/usr/bin:/bin",
                       "TRTEXEC": str(stub)}, capture_output=True, text=True)
    log = art / "engines" / "build.model.fp32.log"
    assert r.returncode == 7 and log.is_file()
    assert "trtexec failed (exit 7) building model (fp32)" in r.stderr
    assert "  | [E] Error[4]: [network.cpp::validate::3000] IShuffleLayer /Reshape: reshape changes volume" in r.stderr
    assert f"the whole log: {log}" in r.stderr
    assert "[I] line 1\n" not in r.stderr and "[I] line 40" in r.stderr  # the end of the log, not all of it
    assert sum(ln.startswith("  | ") for ln in r.stderr.splitlines()) == LOG_TAIL_LINES == 25
