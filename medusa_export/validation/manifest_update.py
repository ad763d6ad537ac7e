"""Adding files and keys to a finished artifact: checksums kept right, manifest replaced atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path

from medusa_runtime.contract.artifact import sha256_file
from medusa_runtime.contract.manifest import MANIFEST, Manifest


def update_manifest(folder: str | Path, patch: dict, files: list[str] = ()) -> Manifest:
    """Merge ``patch`` into the manifest's top level, (re)checksum ``files``, write atomically.

    The new manifest is written to a temporary file in the same folder and renamed over the
    old one, so a reader sees either the old or the new manifest, never a partial one.

    Args:
        folder: the artifact directory.
        patch: top-level keys to set; a dict value is merged one level deep into an existing
            dict (e.g. ``{"engines": {"fp16": {...}}}`` keeps other precisions' records).
        files: artifact-relative paths to add to (or refresh in) ``checksums``.

    Returns:
        The new manifest.

    Raises:
        ArtifactError: the patched manifest is not valid (the old one is kept).
    """
    folder = Path(folder)
    path = folder / MANIFEST
    manifest = Manifest.from_json(json.loads(path.read_text()))
    sums = {}
    for rel in files:
        f = folder / rel
        sums[rel] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    manifest = manifest.merged(patch, sums)
    tmp = path.with_name(f".{MANIFEST}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    os.replace(tmp, path)
    return manifest
