"""The one prompt-file reader (medusa_runtime.front.prompts) and the readers built on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import MT_BENCH
from medusa_runtime.errors import MedusaError, PromptFileError
from medusa_runtime.front.prompts import jsonl_records, read_first_turns, read_prompt_file


def _write(tmp_path, lines: list) -> object:
    f = tmp_path / "p.jsonl"
    f.write_text("".join((x if isinstance(x, str) else json.dumps(x, ensure_ascii=False)) + "\n" for x in lines),
                 encoding="utf-8")
    return f


def test_first_turns_of_every_format_in_order(tmp_path):
    f = _write(tmp_path, [{"prompt": "a"}, "", {"turns": ["b", "second"]},
                          {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "c"}]}])
    assert read_first_turns(f) == ["a", "b", "c"]
    assert read_first_turns(f, 2) == ["a", "b"]
    assert [n for n, _ in jsonl_records(f)] == [1, 3, 4]  # blank lines skipped, numbers are the file's


def test_a_json_string_may_hold_a_line_separator(tmp_path):
    f = _write(tmp_path, [{"prompt": "one\u2028two"}, {"prompt": "three"}])
    assert read_first_turns(f) == ["one\u2028two", "three"]
    assert [r.prompt for r in read_prompt_file(f)] == ["one\u2028two", "three"]


def test_mt_bench_first_turns_are_the_files():
    first = [json.loads(line)["turns"][0] for line in MT_BENCH.read_text().splitlines()[:3]]
    assert read_first_turns(MT_BENCH, 3) == first


@pytest.mark.parametrize("content, message", [
    (None, "prompt file {f} does not exist"),
    ("{\"prompt\": \"a\"}\n{not json\n", "{f}:2: not valid JSON"),
    ("[1, 2]\n", "{f}:1: expected a JSON object, got list"),
    ("{\"prompt\": \"a\"}\n{\"text\": \"b\"}\n", "{f}:2: expected a 'prompt', 'turns' or 'messages' key"),
])
def test_first_turns_errors_name_file_and_line(tmp_path, content, message):
    f = tmp_path / "p.jsonl"
    if content is not None:
        f.write_text(content)
    with pytest.raises(PromptFileError) as exc:
        read_first_turns(f)
    assert str(exc.value).startswith(message.format(f=f)) and isinstance(exc.value, MedusaError)


def test_training_and_validation_read_through_it(tmp_path):
    from medusa_export.training.distill import load_prompts
    from medusa_export.validation.validate import read_prompts

    f = _write(tmp_path, [{"prompt": "a"}, "", {"turns": ["b"], "question_id": 81}, {"text": "skipped"},
                          {"prompt": "c", "source": "mine", "id": "x"}])
    assert [(p.id, p.messages[-1]["content"]) for p in load_prompts(f)] == [("p/0", "a"), ("p/81", "b"),
                                                                             ("mine/x", "c")]
    with pytest.raises(PromptFileError, match=":4: expected a 'prompt', 'turns' or 'messages' key"):
        read_prompts(f)
    assert read_prompts(f, 2) == ["a", "b"]
    with pytest.raises(PromptFileError, match=r"p\.jsonl:2: not valid JSON"):
        load_prompts(_write(tmp_path, [{"prompt": "a"}, "{oops"]))


def test_shared_dir_honours_the_variable_else_the_folder_beside_the_checkout(monkeypatch, tmp_path):
    from pathlib import Path

    from medusa_runtime.front.prompts import mt_bench_questions, shared_dir

    monkeypatch.setenv("MEDUSA_EXPORT_SHARED", str(tmp_path))
    assert shared_dir() == tmp_path
    assert mt_bench_questions() == tmp_path / "data" / "eval" / "mt_bench" / "question.jsonl"
    monkeypatch.delenv("MEDUSA_EXPORT_SHARED")
    assert shared_dir() == Path(__file__).resolve().parents[2] / "shared"


@pytest.mark.parametrize("script, name", [("bench.py", "DEFAULT_QUESTIONS"), ("bench_batch.py", "DEFAULT_QUESTIONS"),
                                          ("compare_acceptance.py", "DEFAULT_QUESTIONS"), ("bench_triton.py", "MT_BENCH")])
def test_every_script_default_goes_through_the_resolver(script, name, tmp_path):
    """Issue 27 item 11: a checkout with no ../shared and MEDUSA_EXPORT_SHARED set: each script's default prompt
    file is the variable's (read in a fresh interpreter, where the scripts compute their defaults at import)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    code = (f"import importlib.util, sys; spec = importlib.util.spec_from_file_location('m', {str(scripts / script)!r}); "
            f"m = importlib.util.module_from_spec(spec); sys.modules['m'] = m; spec.loader.exec_module(m); "
            f"print(m.{name})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "MEDUSA_EXPORT_SHARED": str(tmp_path)}).stdout.strip()
    assert out == str(tmp_path / "data" / "eval" / "mt_bench" / "question.jsonl")


def test_no_script_builds_the_shared_path_by_hand():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    offenders = [p.name for p in sorted((root / "scripts").glob("*.py"))
                 if '/ "shared"' in p.read_text() or "parents[2]" in p.read_text()]
    assert offenders == []


def test_the_suite_reads_only_the_prompts_the_repository_carries():
    """Issue 40 item 5: a fresh clone runs the suite with no shared/ folder beside it. The tests' prompts are the
    repository's own copy (tests/data, source and licence named in its README); no test module reads the shared
    folder's prompt sets (only this module, which tests the lookup the benchmarks use)."""
    from conftest import DATA, MT_BENCH

    assert MT_BENCH.parent == DATA and MT_BENCH.is_file()
    assert "Apache-2.0" in (DATA / "README.md").read_text() and "lm-sys/FastChat" in (DATA / "README.md").read_text()
    readers = [p.name for p in Path(__file__).parent.glob("*.py") if p.name != Path(__file__).name
               and any(s in p.read_text() for s in ("mt_bench_questions(", "shared_dir(", "DEFAULT_QUESTIONS"))]
    assert readers == []
