"""The manifest as typed, versioned data (medusa_runtime.contract.manifest): the shipped JSON Schema is the one the
dataclasses generate, a built artifact's manifest round-trips byte for byte and validates against its schema,
bad documents fail with the key named, and no module outside the manifest code indexes the manifest dict."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.errors import ArtifactError
from medusa_runtime.contract.manifest import MANIFEST_SCHEMA, SUPPORTED_VERSIONS, Manifest, json_schema, schema_text

ROOT = Path(__file__).resolve().parents[1]


def test_docs_schema_is_the_generated_one():
    assert (ROOT / "docs" / "manifest.schema.json").read_text() == schema_text()
    schema = json_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["properties"]["format_version"]["enum"] == list(SUPPORTED_VERSIONS)
    assert set(schema["required"]) == {"format", "format_version", "model", "graphs", "tree", "files", "checksums"}
    assert "num_layers" in schema["$defs"]["ModelInfo"]["required"]
    assert schema["$defs"]["TensorSpec"]["properties"]["shape"]["items"] == {
        "anyOf": [{"type": "integer"}, {"type": "string"}]}


def test_built_manifest_round_trips_and_validates(tiny_trt_artifact):
    art = Path(tiny_trt_artifact)
    text = (art / "manifest.json").read_text()
    doc = json.loads(text)
    m = Manifest.from_json(doc)
    assert m.to_json() == doc and json.dumps(m.to_json(), indent=2) + "\n" == text  # byte for byte
    assert m.model.num_layers == doc["model"]["num_layers"] and m.graphs["model"].inputs[0].name == "input_ids"
    # the schema travels with the artifact, listed and checksummed like every other file
    assert (art / MANIFEST_SCHEMA).read_text() == schema_text()
    assert m.files["manifest_schema"] == MANIFEST_SCHEMA and MANIFEST_SCHEMA in m.checksums
    assert load_artifact(art).manifest == m
    import jsonschema  # the dev extra

    jsonschema.Draft202012Validator(json_schema()).validate(doc)


def _doc(tiny_trt_artifact) -> dict:
    return json.loads((Path(tiny_trt_artifact) / "manifest.json").read_text())


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["model"].pop("num_layers"), r"missing key 'model\.num_layers'"),
    (lambda d: d["model"].update(num_layers="2"), r"'model\.num_layers' must be an integer, got a string \('2'\)"),
    (lambda d: d["graphs"]["heads"]["outputs"][0].update(shape="R"),
     r"'graphs\.heads\.outputs\[0\]\.shape' must be an array"),
    (lambda d: d["checksums"]["tree.json"].update(bytes=None), r"'checksums\.tree\.json\.bytes' must be an integer, got null"),
    (lambda d: d.update(format_version=SUPPORTED_VERSIONS[-1] + 1),
     r"format_version 2 is not supported \(this runtime reads version 1\): upgrade medusa-export"),
    (lambda d: d.update(format_version=0),
     r"format_version 0 is not supported \(this runtime reads version 1\): rebuild the artifact"),
    (lambda d: d.update(format="something-else"), r"format is 'something-else'"),
])
def test_bad_manifests_name_the_key(tiny_trt_artifact, edit, match):
    doc = _doc(tiny_trt_artifact)
    edit(doc)
    with pytest.raises(ArtifactError, match=match):
        Manifest.from_json(doc)


def test_unknown_keys_are_kept(tiny_trt_artifact):
    doc = _doc(tiny_trt_artifact)
    doc["model"]["future_key"] = [1, 2]
    doc["a_newer_section"] = {"x": 1}
    m = Manifest.from_json(copy.deepcopy(doc))
    assert m.model.extra == {"future_key": [1, 2]} and m.extra == {"a_newer_section": {"x": 1}}
    assert m.to_json() == doc
    merged = m.merged({"engines": {"fp16": {"status": "a"}}}, {"x.txt": {"sha256": "0" * 64, "bytes": 1}})
    assert merged.engines == {"fp16": {"status": "a"}} and merged.checksums["x.txt"].bytes == 1
    assert merged.extra == m.extra


_INDEXING = re.compile(r"manifest(\[|\.get\()")
_OWNERS = {"runtime/contract/manifest.py", "medusa_export/export/manifest.py"}


def test_no_module_indexes_the_manifest_dict():
    """Readers go through the typed Manifest; only the manifest code itself touches the JSON document."""
    found = []
    for folder in ("runtime", "medusa_export", "scripts"):
        for path in sorted((ROOT / folder).rglob("*")):
            rel = path.relative_to(ROOT).as_posix()
            if path.suffix not in (".py", ".sh") or rel in _OWNERS:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _INDEXING.search(line):
                    found.append(f"{rel}:{n}: {line.strip()}")
    assert not found, "index the typed Manifest instead:\n" + "\n".join(found)
