"""The issue-27 bad-input catalogue: one case per reproducer, as a new user would meet it.

Each case runs the command line (:func:`medusa_export.cli.main.main`, or a subprocess where a signal is
involved) on a tiny random model and asserts the stated right behaviour: exit code 2 (:data:`EXIT_USAGE`)
with a message that names the problem and the valid choices, before any work is done; the output folder
untouched; nothing left behind. The section comments give the issue's item numbers.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from conftest import save_tiny_hf_dir
from medusa_export.cli.main import main
from medusa_runtime.errors import EXIT_USAGE


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama as an HF folder (2 layers, vocabulary 1001, the tiny BPE tokenizer)."""
    path = tmp_path_factory.mktemp("bad-input") / "tiny-llama"
    save_tiny_hf_dir(path)
    return path


@pytest.fixture(scope="module")
def artifact(tiny_model_dir, tmp_path_factory):
    """An artifact of :func:`tiny_model_dir` (4-node tree, context 256), built without validation."""
    out = tmp_path_factory.mktemp("bad-input-art") / "tiny-t4"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["build", "--model", str(tiny_model_dir), "--tree", "4", "--max-context", "256",
                     "--no-validate", "--out", str(out)]) == 0
    return out


def snapshot(folder) -> dict:
    """Every file under ``folder`` (hidden ones included) with its size and modification time."""
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def error_of(argv, capsys) -> str:
    """Run ``argv``; assert exit code 2 and nothing on stdout (no work reported); the one-line error."""
    assert main(argv) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err, out
    return err


# --- 2. verify --junit into a folder that does not exist -------------------------------------------


def test_verify_junit_in_a_missing_folder_fails_before_the_run(artifact, tiny_model_dir, tmp_path, capsys):
    junit = tmp_path / "nonexistent" / "x.xml"
    err = error_of(["verify", "--artifact", str(artifact), "--model-path", str(tiny_model_dir),
                    "--junit", str(junit)], capsys)
    assert f"--junit {junit}: the folder {junit.parent} does not exist" in err
    assert "loading" not in err and "checks" not in err  # refused before the verification ran
    assert not junit.parent.exists()


def test_verify_junit_at_a_directory_fails(artifact, tiny_model_dir, tmp_path, capsys):
    err = error_of(["verify", "--artifact", str(artifact), "--model-path", str(tiny_model_dir),
                    "--junit", str(tmp_path)], capsys)
    assert f"--junit {tmp_path} is a directory; give a file path" in err


# --- 3. verify never passes on nothing ---------------------------------------------------------------


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_verify_limit_below_one_fails(artifact, tiny_model_dir, limit, capsys):
    err = error_of(["verify", "--artifact", str(artifact), "--model-path", str(tiny_model_dir),
                    "--limit", limit], capsys)
    assert f"--limit must be >= 1, got {limit}" in err


@pytest.mark.parametrize("command", ["verify", "build"])
def test_an_empty_prompt_file_fails(command, artifact, tiny_model_dir, tmp_path, capsys):
    """verify does not pass on 0 prompts; build does not swap the empty file for its default prompts."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    if command == "verify":
        argv = ["verify", "--artifact", str(artifact), "--model-path", str(tiny_model_dir)]
    else:
        argv = ["build", "--model", str(tiny_model_dir), "--tree", "4", "--out", str(tmp_path / "art")]
    before = snapshot(artifact)
    err = error_of(argv + ["--prompt-file", str(empty)], capsys)
    assert f"prompt file {empty} holds no prompts; JSONL" in err and "'prompt'" in err
    assert snapshot(artifact) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]  # nothing built, nothing left


# --- 1. SIGTERM during build leaves nothing; a later build removes what a killed one left -----------------


def test_sigterm_mid_build_removes_the_temporary_folder(tiny_model_dir, tmp_path):
    """``timeout -s TERM`` / ``kill`` / a CI cancel while the build validates: exit 143, nothing left beside
    ``--out`` (SIGINT was already clean; SIGTERM left ``.NAME.partial-PID``)."""
    out = tmp_path / "term"
    proc = subprocess.Popen([sys.executable, "-m", "medusa_export.cli", "build", "--model", str(tiny_model_dir),
                             "--tree", "4", "--max-context", "256", "--max-new-tokens", "8", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    partial = tmp_path / f".term.partial-{proc.pid}"
    deadline = time.monotonic() + 120
    while not (partial / "manifest.json").exists():  # the export is written: the build is mid-way
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "medusa-export: terminated (SIGTERM)" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # no partial folder, no lock file, no artifact


def test_sighup_is_handled_as_ctrl_c():
    from medusa_runtime.front.cli import Terminated, signals_as_interrupt

    previous = signal.getsignal(signal.SIGHUP)
    with pytest.raises(Terminated) as exc, signals_as_interrupt():
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(5)  # the handler raises at the next bytecode
    assert exc.value.signum == signal.SIGHUP and isinstance(exc.value, KeyboardInterrupt)
    assert signal.getsignal(signal.SIGHUP) is previous


def test_a_build_removes_the_folders_a_killed_build_left(tiny_model_dir, tmp_path, capsys):
    """A build killed with SIGKILL cannot clean up: the next build into the same --out removes its
    ``.NAME.partial-PID`` (and ``.NAME.old-PID``) once that PID is not running; a running one's are kept."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # its PID is not running now
    left = [tmp_path / f".art.partial-{dead.pid}", tmp_path / f".art.old-{dead.pid}"]
    alive = tmp_path / f".art.partial-{os.getppid()}"  # a running process's
    for folder in left + [alive]:
        (folder / "tokenizer").mkdir(parents=True)
        (folder / "weights.bin").write_bytes(b"\0" * 1000)
    assert main(["build", "--model", str(tiny_model_dir), "--tree", "4", "--max-context", "256", "--no-validate",
                 "--out", str(tmp_path / "art")]) == 0
    assert f"removed .art.partial-{dead.pid}, left by a build that did not finish" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([alive.name, "art"])


# --- 9. rebuilding into an existing artifact; two builds into one --out ---------------------------------


def test_rebuilding_into_an_artifact_needs_force(tiny_model_dir, tmp_path, capsys):
    """``engines/`` plans and files added by hand were deleted without notice; now named, and kept without --force."""
    out = tmp_path / "art"
    argv = ["build", "--model", str(tiny_model_dir), "--tree", "4", "--max-context", "256", "--no-validate",
            "--out", str(out)]
    assert main(argv) == 0
    (out / "engines" / "fp16").mkdir(parents=True)
    (out / "engines" / "fp16" / "step.plan").write_bytes(b"plan")
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    before = snapshot(out)
    err = error_of(argv, capsys)
    assert f"--out {out} already holds an artifact (model tiny-llama, 13 files," in err
    assert ("and what a build does not write: the TensorRT files of `medusa-export engine`: engines/fp16/step.plan "
            "(4 B); other files: notes.txt, which would all be deleted. Give --force to replace all of it") in err
    assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    assert main(argv + ["--force"]) == 0
    assert not (out / "engines").exists() and not (out / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]  # no lock file, no partial folder


def test_a_folder_that_is_not_an_artifact_is_never_replaced(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "thesis.tex").write_text("years of work")
    err = error_of(["build", "--model", str(tiny_model_dir), "--tree", "4", "--force", "--out",
                    str(tmp_path / "art")], capsys)
    assert "is a non-empty folder that is not an artifact (no manifest.json); refusing to replace it" in err
    assert (tmp_path / "art" / "thesis.tex").read_text() == "years of work"


def test_a_second_build_into_the_same_out_is_refused(tiny_model_dir, tmp_path, capsys):
    """Two builds into one --out both printed success; the second now waits for nothing and says who writes."""
    from medusa_export.files import OutputLock

    out = tmp_path / "art"
    with OutputLock(out):  # another build (flock is per open file, so this process's own build is "another")
        err = error_of(["build", "--model", str(tiny_model_dir), "--tree", "4", "--max-context", "256",
                        "--no-validate", "--out", str(out)], capsys)
    assert f"another process (PID {os.getpid()}) is writing {out} (it holds {tmp_path / '.art.lock'}); wait" in err
    assert list(tmp_path.iterdir()) == []


def test_an_out_where_no_lock_file_can_be_made_is_a_typed_error(tiny_model_dir, capsys):
    """/proc passes os.access for root but refuses new files: the lock file's open raised FileNotFoundError, a
    traceback with exit code 1 (the code of a mismatch); now rc 2 naming the folder and the lock file."""
    err = error_of(["build", "--model", str(tiny_model_dir), "--tree", "4", "--max-context", "256",
                    "--no-validate", "--out", "/proc/medusa-export-art"], capsys)
    assert "output folder /proc/medusa-export-art cannot be written: the lock file /proc/.medusa-export-art.lock" in err
    assert "choose an output folder on a writable file system" in err
    assert not os.path.exists("/proc/medusa-export-art")


# --- 7. --threads out of range --------------------------------------------------------------------------


@pytest.mark.parametrize("threads", ["-1", "0", "100000"])
@pytest.mark.parametrize("command", ["generate", "triton"])
def test_threads_out_of_range_fails_before_a_session_is_made(command, threads, artifact, tmp_path, capsys):
    """--threads 100000 hung inside ONNX Runtime's session creation; -1 was accepted."""
    tail = ["--prompt", "hi"] if command == "generate" else ["--out", str(tmp_path / "repo")]
    err = error_of([command, "--artifact", str(artifact), "--threads", threads, *tail], capsys)
    assert f"--threads must be in 1..256 (this machine has {os.cpu_count()} CPUs), got {threads}" in err
    assert list(tmp_path.iterdir()) == []


def test_threads_above_the_cpu_count_runs_with_a_note(artifact, capsys):
    threads = str(os.cpu_count() + 1)
    assert main(["generate", "--artifact", str(artifact), "--prompt", "hi", "--max-new-tokens", "2",
                 "--threads", threads]) == 0
    assert f"[note: --threads {threads} is more than this machine's {os.cpu_count()} CPUs" in capsys.readouterr().err


def test_spin_is_an_onnxruntime_option_and_spins_the_step_session_only(artifact, capsys, monkeypatch):
    """--spin: the step session's threads busy-wait, the heads session's do not (two spinning pools fight for the
    cores); on another backend it is a typed usage error naming the backend to use."""
    from medusa_runtime.front import session as front_session

    err = error_of(["generate", "--artifact", str(artifact), "--prompt", "hi", "--spin", "--backend", "tensorrt"],
                   capsys)
    assert "--spin sets the onnxruntime backend's CPU threads: use it with --backend onnxruntime" in err
    made = []
    real = front_session.create_engine
    monkeypatch.setattr(front_session, "create_engine", lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    assert main(["generate", "--artifact", str(artifact), "--prompt", "hi", "--max-new-tokens", "2", "--spin",
                 "--tree", "root"]) == 0
    spinning = {name: s.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
                for name, s in (("step", made[0].step_session), ("heads", made[0].heads_session))}
    assert made[0].spin and spinning == {"step": "1", "heads": "0"}
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.engines.ort import OrtEngine
    from medusa_runtime.tuning.treecache import backend_fingerprint

    assert backend_fingerprint("onnxruntime", made[0], None)["spin"] is True  # a tree timed spinning is its own record
    assert "spin" not in backend_fingerprint("onnxruntime", OrtEngine(load_artifact(artifact)), None)


# --- 4. manifest fields checked against the graphs when an artifact is opened ---------------------------


def _edited_copy(artifact, tmp_path, edit) -> object:
    """A copy of ``artifact`` whose manifest.json went through ``edit(doc)``."""
    import json
    import shutil

    out = tmp_path / "edited"
    shutil.copytree(artifact, out)
    doc = json.loads((out / "manifest.json").read_text())
    edit(doc)
    (out / "manifest.json").write_text(json.dumps(doc))
    return out


def _output(doc, graph, name) -> dict:
    return next(t for t in doc["graphs"][graph]["outputs"] if t["name"] == name)


def test_an_edited_step_topk_is_refused_on_open(artifact, tmp_path, capsys):
    """step_topk 10 -> 20 was accepted although topk_ids is [1, S, 10]; --top-k 15 then sampled other tokens."""
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.errors import ArtifactError

    k = load_artifact(artifact).manifest.step_topk
    edited = _edited_copy(artifact, tmp_path, lambda doc: doc.update(step_topk=2 * k))
    with pytest.raises(ArtifactError) as exc:
        load_artifact(edited)
    assert f"step_topk is {2 * k} but graphs.model output topk_ids has shape [1, 'S', {k}]" in str(exc.value)
    err = error_of(["generate", "--artifact", str(edited), "--prompt", "hi", "--top-k", "15"], capsys)
    assert f"step_topk is {2 * k}" in err


def test_an_io_list_edited_to_match_is_refused_against_the_onnx_file(artifact, tmp_path):
    """Editing the manifest's I/O list along with step_topk: the ONNX file's declared shape still says k."""
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.errors import ArtifactError

    k = load_artifact(artifact).manifest.step_topk

    def edit(doc):
        doc["step_topk"] = 2 * k
        for name in ("topk_ids", "topk_logprobs"):
            _output(doc, "model", name)["shape"][-1] = 2 * k

    with pytest.raises(ArtifactError) as exc:
        load_artifact(_edited_copy(artifact, tmp_path, edit))
    assert (f"graphs.model outputs disagree with model.onnx: topk_ids has shape [1, 'S', {2 * k}] in the manifest, "
            f"[1, 'S', {k}] in the file") in str(exc.value)


@pytest.mark.parametrize("field, value, message", [
    ("hidden_size", 65, "model.hidden_size is 65 but graphs.model output hidden_states has shape [1, 'S', 64]"),
    ("medusa_heads", 5, "the heads graph outputs ['R', 4, 10] but the manifest has 5 Medusa heads"),
    ("num_kv_heads", 3, "but the model section says 3 KV heads"),
])
def test_an_edited_model_field_is_refused_on_open(field, value, message, artifact, tmp_path):
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.errors import ArtifactError

    with pytest.raises(ArtifactError) as exc:
        load_artifact(_edited_copy(artifact, tmp_path, lambda doc: doc["model"].update({field: value})))
    assert message in str(exc.value)


def test_an_edited_heads_count_is_refused_on_open(artifact, tmp_path):
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.errors import ArtifactError

    with pytest.raises(ArtifactError) as exc:
        load_artifact(_edited_copy(artifact, tmp_path, lambda doc: doc["heads"].update(num_heads=3)))
    assert "heads.num_heads is 3 but graphs.heads output medusa_topk_ids has shape ['R', 4, 10]" in str(exc.value)


def test_an_edited_kv_dtype_is_refused_on_open(artifact, tmp_path):
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.errors import ArtifactError

    with pytest.raises(ArtifactError) as exc:
        load_artifact(_edited_copy(artifact, tmp_path, lambda doc: doc["precision"].update(kv_dtype="float16")))
    assert "precision.kv_dtype is float16 but graphs.model input past_key_values.0.key is float32" in str(exc.value)


def test_the_onnx_reader_matches_onnx(artifact):
    """medusa_runtime.contract.onnx_io reads the declared I/O as the onnx package does (names, types, dims)."""
    import onnx

    from medusa_runtime.contract.onnx_io import ELEM_TYPES, declared_io

    for name in ("model.onnx", "heads.onnx"):
        proto = onnx.load(str(artifact / name), load_external_data=False).graph
        want = [(v.name, ELEM_TYPES[v.type.tensor_type.elem_type],
                 [d.dim_value if d.HasField("dim_value") else d.dim_param for d in v.type.tensor_type.shape.dim])
                for v in [*proto.input, *proto.output]]
        io = declared_io(artifact / name)
        assert [tuple(t) for t in [*io.inputs, *io.outputs]] == want


# --- 10. Python API: prompt_ids that are not token ids ---------------------------------------------------


@pytest.fixture(scope="module")
def session(artifact):
    from medusa_runtime.front.session import MedusaSession

    return MedusaSession(artifact, threads=1, tree="artifact", notice=None)


@pytest.mark.parametrize("ids, message", [
    ([5, -1], "prompt_ids[1] = -1 is out of range: token ids are integers in 0..1000 (vocabulary 1001)"),
    ([1.5], "prompt_ids[0] = 1.5 (float) is not a token id: token ids are integers in 0..1000 (vocabulary 1001)"),
    ([3.0], "prompt_ids[0] = 3.0 (float) is not a token id"),
    ([True], "prompt_ids[0] = True (bool) is not a token id"),
    ([7, 1001], "prompt_ids[1] = 1001 is out of range: token ids are integers in 0..1000 (vocabulary 1001)"),
])
@pytest.mark.parametrize("call", ["generate", "generate_batch"])
def test_prompt_ids_that_are_not_token_ids_are_a_medusa_error(session, call, ids, message):
    """Negative ids wrapped around silently, [1.5] was accepted, ids >= V raised onnxruntime's InvalidArgument."""
    from medusa_runtime.errors import InvalidPromptError, MedusaError

    with pytest.raises(InvalidPromptError) as exc:
        if call == "generate":
            session.generate(prompt_ids=ids, max_new_tokens=2)
        else:
            session.generate_batch(prompt_ids=[[1, 2], ids], max_new_tokens=2)
    assert isinstance(exc.value, MedusaError) and message in str(exc.value)
    if call == "generate_batch":
        assert str(exc.value).startswith("prompt 1: ")


def test_the_last_token_id_and_numpy_ids_are_accepted(session):
    import numpy as np

    a = session.generate(prompt_ids=[1000, 5], max_new_tokens=3)
    b = session.generate(prompt_ids=np.array([1000, 5], dtype=np.int32), max_new_tokens=3)
    assert a.token_ids == b.token_ids and a.prompt_tokens == b.prompt_tokens == 2


# --- 5. --max-context against the validation prompts and the model ---------------------------------------


def test_a_full_context_reports_the_tokens_really_compared(tiny_model_dir, tmp_path, capsys):
    """--max-context 150: the first prompt (88 tokens with the template) + 64 new tokens do not fit; the summary
    said "3/3 prompts x 64 tokens" although the manifest recorded fewer for it."""
    out = tmp_path / "art"
    with contextlib.redirect_stdout(io.StringIO()) as stdout:
        assert main(["build", "--model", str(tiny_model_dir), "--tree", "4", "--max-context", "150",
                     "--out", str(out)]) == 0
    err = capsys.readouterr().err
    counts = [p["tokens"] for p in json.loads((out / "manifest.json").read_text())["validation"]["prompts"]]
    assert counts[0] < 64 and counts[1:] == [64, 64]
    assert ("[note: validation prompt 1 has 88 tokens: with --max-new-tokens 64 it needs 152 > --max-context 150, "
            "so it is compared on fewer tokens]") in err
    assert f"identical to the reference on 3/3 prompts x {'/'.join(map(str, counts))} of 64 tokens (fewer where EOS" in stdout.getvalue()


def test_a_validation_prompt_longer_than_the_context_fails_before_the_export(tiny_model_dir, tmp_path, capsys):
    err = error_of(["build", "--model", str(tiny_model_dir), "--tree", "4", "--max-context", "80",
                    "--out", str(tmp_path / "art")], capsys)
    assert ("validation prompt 1 ('Write a short note to a colleague explai') has 88 tokens with the chat template, "
            "which leaves no room in --max-context 80: give --max-context >= 152") in err
    assert "--prompt-file, or --no-validate" in err and "[1/" not in err  # no stage started
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("context, message", [
    ("999999", "--max-context must be in 2..4096 (tiny-llama's max_position_embeddings is 4096), got 999999"),
    ("0", "--max-context must be >= 2, got 0"),
    ("-5", "--max-context must be >= 2, got -5"),
])
def test_max_context_outside_the_models_positions_fails(tiny_model_dir, tmp_path, context, message, capsys):
    err = error_of(["build", "--model", str(tiny_model_dir), "--tree", "4", "--max-context", context,
                    "--out", str(tmp_path / "art")], capsys)
    assert message in err
    assert list(tmp_path.iterdir()) == []


# --- 6. typed errors instead of tracebacks --------------------------------------------------------------


def test_a_model_folder_without_a_tokenizer_fails(tiny_model_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").unlink()  # was an AttributeError deep inside transformers
    err = error_of(["build", "--model", str(model), "--tree", "4", "--out", str(tmp_path / "art")], capsys)
    assert (f"{model} has no tokenizer: expected one of tokenizer.json, tokenizer.model, vocab.json, "
            "tokenizer.tiktoken beside config.json") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_string_where_config_json_needs_an_integer_fails(tiny_model_dir, tmp_path, capsys):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "hidden_size": "64"}))
    err = error_of(["build", "--model", str(model), "--tree", "4", "--out", str(tmp_path / "art")], capsys)
    assert "config.json: hidden_size must be a non-negative integer, got '64' (str)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_prompt_that_is_not_utf8_fails(artifact, capsys):
    """Bytes that are not UTF-8 on the command line reach Python as lone surrogates (PEP 383)."""
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")
    err = error_of(["generate", "--artifact", str(artifact), "--prompt", prompt], capsys)
    assert "--prompt is not valid UTF-8 (byte 0xe9 at character 3); give the text in UTF-8" in err


@pytest.mark.parametrize("content, message", [
    (b'{"prompt": "caf\xe9"}\n', "{f}:1: not UTF-8 (byte 0xe9 at offset 15); prompt files are JSONL in UTF-8"),
    (None, "prompt file {f} is a directory; give a JSONL file"),  # 12: it said "does not exist"
])
@pytest.mark.parametrize("command", ["verify", "generate"])
def test_a_prompt_file_that_cannot_be_read_fails(command, content, message, artifact, tiny_model_dir, tmp_path,
                                                 capsys):
    f = tmp_path / "prompts.jsonl"
    if content is None:
        f.mkdir()
    else:
        f.write_bytes(content)
    extra = ["--model-path", str(tiny_model_dir)] if command == "verify" else []
    err = error_of([command, "--artifact", str(artifact), *extra, "--prompt-file", str(f)], capsys)
    assert message.format(f=f) in err


def test_verify_against_a_model_with_another_vocabulary_fails(artifact, tmp_path, capsys):
    """Was onnxruntime's Gather INVALID_ARGUMENT traceback."""
    other = tmp_path / "other"
    save_tiny_hf_dir(other, vocab=320)
    err = error_of(["verify", "--artifact", str(artifact), "--model-path", str(other)], capsys)
    assert f"{other} is not the model this artifact was built from (vocab_size 1001 vs 320; artifact vs checkpoint)" \
        in err


# --- 12. small ones -------------------------------------------------------------------------------------


def test_an_empty_stop_string_fails(artifact, capsys):
    err = error_of(["generate", "--artifact", str(artifact), "--prompt", "hi", "--stop", ""], capsys)
    assert "--stop '' is empty: a stop string needs at least one character" in err


def test_the_artifact_doc_names_an_importable_loader():
    import importlib
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "artifact.md").read_text()
    for module, name in re.findall(r"`(medusa_runtime(?:\.\w+)*)\.(load_artifact)`", doc):
        assert callable(getattr(importlib.import_module(module), name)), f"{module}.{name}"
    assert "medusa_runtime.contract.artifact.load_artifact" in doc


def test_no_source_cites_notes_outside_the_repository():
    """A docstring of scripts/make_random_checkpoint.py cited /work/notes/..., which no clone has."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cited = [str(p.relative_to(root)) for folder in ("scripts", "medusa_export", "runtime", "docs")
             for p in (root / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")
             and "/work/notes" in p.read_text(errors="replace")]
    assert cited == []
# --- 6, 12. --tree values that are not a tree (build and generate) ---------------------------------


@pytest.fixture(scope="module")
def bad_tree_files(tmp_path_factory):
    """A folder, a non-UTF-8 tree file and a valid JSON tree under one temporary folder."""
    root = tmp_path_factory.mktemp("bad-trees")
    (root / "a-folder").mkdir()
    (root / "latin1.json").write_bytes(b'[[0], "\xe9"]')
    return root


@pytest.mark.parametrize("spec, expected", [
    ("", "--tree is empty"),
    ("a-folder", "is a directory"),
    ("latin1.json", "is not UTF-8"),
])
def test_build_refuses_a_tree_that_is_not_a_tree(spec, expected, tiny_model_dir, bad_tree_files, tmp_path, capsys):
    tree = str(bad_tree_files / spec) if spec else spec
    out = tmp_path / "never-written"
    err = error_of(["build", "--model", str(tiny_model_dir), "--tree", tree, "--no-validate", "--out", str(out)],
                   capsys)
    assert expected in err
    if spec in ("", "a-folder"):  # the message lists what a tree spec may be
        assert "node budget" in err and "chain" in err and "dynamic:T" in err
    assert not out.exists()


@pytest.mark.parametrize("argv, expected", [
    (["--tree", ""], "--tree is empty"),
    (["--tree", "{folder}"], "is a directory"),
    (["--out", "{folder}"], "is a non-empty folder that is not an artifact"),
    (["--tree", "0"], "a tree has at least 1 node (the root), got --tree 0: give a node budget"),
    (["--tree", "-3"], "a tree has at least 1 node (the root), got --tree -3: give a node budget"),  # was "unknown tree"
    (["--tree=-3"], "a tree has at least 1 node (the root), got --tree -3: give a node budget"),
    (["--tree", "\u00b2"], "unknown tree '\u00b2': give a node budget"),  # str.isdigit() is True: was a ValueError
    (["--tree", "dynamic:\u00b2"], "--tree dynamic:T takes a node count T >= 1"),
    (["--tree", "artifact"], "build writes the artifact, so --tree artifact has no tree to take"),
])
def test_build_refuses_a_bad_tree_or_out_before_it_opens_the_model(argv, expected, tmp_path, monkeypatch, capsys):
    """These waited for the model to open (16-21 s on the embedded model) before they were refused."""
    import medusa_export.loading.sources as sources

    def opened(*args, **kwargs):
        raise AssertionError("build opened the model before it checked --tree and --out")

    monkeypatch.setattr(sources, "open_model", opened)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "kept.txt").write_text("mine")
    argv = [a.format(folder=tmp_path / "folder") for a in argv]
    assert expected in error_of(["build", "--model", "smollm2-135m", *argv], capsys)
    assert (tmp_path / "folder" / "kept.txt").read_text() == "mine"


@pytest.mark.parametrize("argv, folder", [
    (["--tree", "64"], "smollm2-135m-t64-fp32"),
    ([], "smollm2-135m-t16-fp32"),  # the registry's default tree
    (["--tree", "dynamic:8", "--precision", "fp16"], "smollm2-135m-tdyn8-fp16"),
    (["--tree", "auto", "--graph", "fused"], "smollm2-135m-tauto-fp32-fused"),
])
def test_build_refuses_an_existing_default_out_before_it_opens_the_model(argv, folder, tmp_path, monkeypatch,
                                                                         capsys):
    """A second `build --model smollm2-135m --tree 64` (default --out, no --force) was refused only after the
    ~20 s model open, with the "opening ..." line printed first; an explicit --out was already checked early."""
    import medusa_export.loading.sources as sources

    def opened(*args, **kwargs):
        raise AssertionError("build opened the model before it checked the default --out")

    monkeypatch.setattr(sources, "open_model", opened)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "artifacts" / folder
    out.mkdir(parents=True)
    (out / "manifest.json").write_text(json.dumps({"model": {"name": "smollm2-135m"}, "checksums": {}}))
    err = error_of(["build", "--model", "smollm2-135m", *argv], capsys)
    assert f"the default --out artifacts/{folder} already holds an artifact (model smollm2-135m" in err
    assert "Give --force to replace all of it, or choose another --out" in err and "opening" not in err
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]


def test_build_names_the_largest_tree_the_heads_make(tiny_model_dir, tmp_path, capsys):
    """--tree 5000 was silently capped at 1111 nodes (3 heads of top-10): a budget above what the heads can make
    is refused with the range; the largest is what the greedy builder makes from an unbounded budget."""
    import re

    from medusa_runtime.trees.tree import default_accuracies, greedy_tree

    out = tmp_path / "x"
    err = error_of(["build", "--model", str(tiny_model_dir), "--tree", "999999", "--no-validate", "--out", str(out)],
                   capsys)
    found = re.search(r"(\d+) heads of top-(\d+) make at most (\d+) nodes \(root included\); give 1\.\.(\d+)", err)
    assert found, err
    heads, topk, most, upper = map(int, found.groups())
    assert most == upper == greedy_tree(10**6, default_accuracies(heads, topk)).size
    assert not out.exists()


@pytest.mark.parametrize("spec, expected", [
    ("", "--tree is empty"),
    ("a-folder", "is a directory"),
    ("latin1.json", "is not UTF-8"),
])
def test_generate_refuses_a_tree_that_is_not_a_tree(spec, expected, artifact, bad_tree_files, capsys):
    before = snapshot(artifact)
    tree = str(bad_tree_files / spec) if spec else spec
    err = error_of(["generate", "--artifact", str(artifact), "--tree", tree, "--prompt", "hi"], capsys)
    assert expected in err
    assert snapshot(artifact) == before


def test_the_python_api_refuses_an_empty_tree_spec(artifact):
    from medusa_runtime.errors import InvalidTreeError
    from medusa_runtime.front.session import MedusaSession

    with pytest.raises(InvalidTreeError, match="--tree is empty: give a node budget"):
        MedusaSession(artifact, tree="  ", notice=None)


# --- 8. a temperature so high that float32 log-probabilities tie ----------------------------------------


def test_a_temperature_above_the_float32_bound_fails(artifact, capsys):
    """--temperature 1e7 made every log-prob a tie (the top-k became token ids 0..9): refused, with the bound."""
    from medusa_runtime.decode.acceptance import MAX_TEMPERATURE

    err = error_of(["generate", "--artifact", str(artifact), "--prompt", "hi", "--temperature", "1e7"], capsys)
    assert f"temperature must be at most {MAX_TEMPERATURE:g}, got 1e+07" in err and "give 0 (greedy)" in err


# --- a new user's pass over the README ------------------------------------------------------------------


@pytest.mark.parametrize("runtime_cli", [False, True])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_an_artifact_that_is_a_file_is_named_as_one(command, runtime_cli, tmp_path, capsys):
    """`medusa_runtime generate --artifact README.md` said "artifact directory README.md does not exist"."""
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.front.cli import main as runtime_main
    from medusa_runtime.errors import ArtifactError

    readme = tmp_path / "README.md"
    readme.write_text("# not an artifact\n")
    argv = [command, "--artifact", str(readme), *(["--prompt", "hi"] if command == "generate" else [])]
    assert (runtime_main if runtime_cli else main)(argv) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert f"{readme} is a file, not an artifact directory: an artifact is the folder `medusa-export build` " \
           "writes" in err
    assert "does not exist" not in err and "Traceback" not in err and out == ""
    with pytest.raises(ArtifactError, match="artifact directory .*missing.* does not exist: an artifact is the"):
        load_artifact(tmp_path / "missing")
