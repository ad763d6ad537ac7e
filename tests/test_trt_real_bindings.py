"""The EMULATED TensorRT of tests/emulated held to TensorRT's real Python bindings (issue 39, item 1).

Releases checked, pinned here (:data:`RELEASES`): ``tensorrt-cu12-bindings==10.16.1.11`` (TensorRT 10.x) and
``tensorrt-cu13-bindings==11.4.0.106`` (TensorRT 11.x), NVIDIA's PyPI wheels of the bindings alone (about 1.3 MB;
the module is ``tensorrt_bindings``). Each wheel is downloaded once (``pip download --no-deps`` into pytest's cache
folder, or taken from the folder ``MEDUSA_TRT_BINDINGS_WHEELS`` names), unzipped, and imported in a subprocess with
stub libraries on ``LD_LIBRARY_PATH``: libnvinfer.so.N, libnvonnxparser.so.N and libnvinfer_plugin.so.N (N = the
major), compiled here with ``cc`` from :data:`STUB_C`, which defines the C symbols the bindings' ``tensorrt.so``
imports and returns NULL / 0 from each. Nothing can be created through them, but every class, enum member (with
its value), method (with the parameter names of its pybind signature lines) and property (with its setter or
none) of that release can be read: that is the reference (tests/trt_api.py reads it).

Against it, in a subprocess per release with ``EMULATED_TENSORRT_VERSION`` set to the release's version:

* (a) every public class, enum member, method (parameter names) and property the emulation offers exists in the
  real bindings; names starting with ``_``, ``emulator_*``, ``EMULATED`` and ``PLAN_MAGIC`` are the emulator's own
  and left out, as are constructors of classes TensorRT makes itself (no Python constructor in the bindings);
* (b) every TensorRT name the project's builder and runtime read, write, construct or probe while they build fp32,
  fp16 and the explicit-Q/DQ int8 / int4 engines of a tiny artifact and generate with the tensorrt backend (recorded on the emulated module, its
  classes and their instances) exists in the real bindings, writable where written;
* the emulated objects accept exactly the attribute writes the real classes accept among a set of probes
  (``layer.precision = ...`` and ``config.int8_calibrator = ...`` raise AttributeError under 11, as pybind does).

Under ``MEDUSA_EXPORT_CI=1`` a wheel that cannot be downloaded or a missing ``cc`` fails the test; elsewhere it
skips with the reason. ``MEDUSA_TRT_EMULATION_DIR`` points the checks at another copy of tests/emulated (e.g. an
older commit's).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import skip_or_fail_in_ci
from trt_api import WRITE_PROBES, compare_accesses, compare_api

HERE = Path(__file__).resolve().parent
EMULATED = Path(os.environ.get("MEDUSA_TRT_EMULATION_DIR") or HERE / "emulated")

#: major -> (PyPI distribution, pinned release) of the real bindings checked.
RELEASES = {10: ("tensorrt-cu12-bindings", "10.16.1.11"), 11: ("tensorrt-cu13-bindings", "11.4.0.106")}
WHEELS_ENV = "MEDUSA_TRT_BINDINGS_WHEELS"

#: The C symbols the bindings' tensorrt.so takes from libnvinfer / libnvonnxparser / libnvinfer_plugin
#: (``nm -D --undefined-only tensorrt.so``), each returning NULL / 0.
STUB_C = """
void* createInferBuilder_INTERNAL(void* l, int v) { return 0; }
void* createInferRefitter_INTERNAL(void* e, void* l, int v) { return 0; }
void* createInferRuntime_INTERNAL(void* l, int v) { return 0; }
void* createNvOnnxParser_INTERNAL(void* n, void* l, int v) { return 0; }
void* createNvOnnxParserRefitter_INTERNAL(void* r, void* l, int v) { return 0; }
int getNvOnnxParserVersion(void) { return 0; }
void* getPluginRegistry(void) { return 0; }
void* getBuilderPluginRegistry(int t) { return 0; }
int initLibNvInferPlugins(void* l, const char* n) { return 0; }
"""
STUB_LIBRARIES = ("libnvinfer.so.{n}", "libnvonnxparser.so.{n}", "libnvinfer_plugin.so.{n}")


def _wheel(dist: str, version: str, cache: Path) -> Path:
    """The release's wheel for this Python: from ``$MEDUSA_TRT_BINDINGS_WHEELS``, the cache, or ``pip download
    --no-deps`` (into the cache)."""
    pattern = f"{dist.replace('-', '_')}-{version}-cp{sys.version_info.major}{sys.version_info.minor}-*.whl"
    for folder in (os.environ.get(WHEELS_ENV), cache):
        if folder and sorted(Path(folder).glob(pattern)):
            return sorted(Path(folder).glob(pattern))[0]
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(cache),
                        f"{dist}=={version}"], capture_output=True, text=True, timeout=600)
    found = sorted(cache.glob(pattern))
    if r.returncode or not found:
        skip_or_fail_in_ci(f"could not download {dist}=={version} (the real TensorRT bindings this test checks the "
                           f"emulation against): {(r.stderr or r.stdout)[-800:]}")
    return found[0]


def _stub_libraries(folder: Path, major: int) -> Path:
    cc = shutil.which("cc")
    if cc is None:
        skip_or_fail_in_ci("no C compiler (`cc`) to build the stub TensorRT libraries the real bindings load")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "stub.c").write_text(STUB_C)
    for name in STUB_LIBRARIES:
        r = subprocess.run([cc, "-shared", "-fPIC", "-o", str(folder / name.format(n=major)), str(folder / "stub.c")],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    return folder


@pytest.fixture(scope="session")
def real_api(request, tmp_path_factory):
    """major -> the real bindings' API (:func:`trt_api.dump_api`), read once per session."""
    cache_root = getattr(request.config, "cache", None)
    cache = Path(cache_root.mkdir("tensorrt-bindings-wheels")) if cache_root else tmp_path_factory.mktemp("wheels")
    apis: dict[int, dict] = {}

    def get(major: int) -> dict:
        if major not in apis:
            dist, version = RELEASES[major]
            wheel = _wheel(dist, version, cache)
            work = tmp_path_factory.mktemp(f"trt{major}")
            with zipfile.ZipFile(wheel) as z:
                z.extractall(work / "wheel")
            libs = _stub_libraries(work / "stub", major)
            env = {**os.environ, "PYTHONPATH": str(work / "wheel"),
                   "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(libs), os.environ.get("LD_LIBRARY_PATH")]))}
            r = subprocess.run([sys.executable, str(HERE / "trt_api.py"), "real", str(work / "api.json")], env=env,
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr[-3000:]
            apis[major] = json.loads((work / "api.json").read_text())
            assert apis[major]["version"] == version
        return apis[major]

    return get


@pytest.fixture(scope="session")
def emulated_run(tiny_trt_artifact, tmp_path_factory):
    """major -> the emulated run of tests/trt_api.py (its API, write probes, scenario and recorded accesses) with
    ``EMULATED_TENSORRT_VERSION`` set to the pinned release, once per session."""
    runs: dict[int, dict] = {}

    def get(major: int) -> dict:
        if major not in runs:
            work = tmp_path_factory.mktemp(f"emulated{major}")
            art = shutil.copytree(tiny_trt_artifact, work / "art")
            env = {**os.environ, "EMULATED_TENSORRT_VERSION": RELEASES[major][1],
                   "PYTHONPATH": os.pathsep.join([str(EMULATED), *sys.path])}
            r = subprocess.run([sys.executable, str(HERE / "trt_api.py"), "emulated", str(work / "run.json"), str(art)],
                               env=env, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
            runs[major] = json.loads((work / "run.json").read_text())
        return runs[major]

    return get


@pytest.mark.parametrize("major", sorted(RELEASES))
def test_the_real_bindings_read_as_the_headers_say(real_api, major):
    """The reference itself: the dump of the real bindings has what NvInfer.h of that major says (BuilderFlag values,
    the weak-typing API present in 10 and gone in 11, STRONGLY_TYPED kept) and the parameter names of a pybind
    signature line, so the comparisons below read a real API, not an empty one."""
    api = real_api(major)
    flags = api["classes"]["BuilderFlag"]["members"]
    assert flags["TF32"] == 6 and "STRONGLY_TYPED" in api["classes"]["NetworkDefinitionCreationFlag"]["members"]
    set_shape = api["classes"]["IOptimizationProfile"]["attrs"]["set_shape"]["sigs"]
    assert [[p for p, _ in s] for s in set_shape] == [["input", "min", "opt", "max"]]
    assert api["classes"]["ITensor"]["attrs"]["name"] == {"kind": "property", "writable": True}
    assert api["classes"]["ICudaEngine"]["constructor"] is None and api["classes"]["Builder"]["constructor"]
    layer = api["classes"]["ILayer"]["attrs"]
    if major == 10:
        assert (flags["FP16"], flags["INT8"], flags["OBEY_PRECISION_CONSTRAINTS"], flags["BF16"]) == (0, 1, 9, 17)
        assert layer["precision"]["writable"] and "IInt8EntropyCalibrator2" in api["module"]
    else:
        assert not {"FP16", "BF16", "INT8", "FP8", "OBEY_PRECISION_CONSTRAINTS"} & set(flags)
        assert "precision" not in layer and "set_output_type" not in layer
        assert "IInt8EntropyCalibrator2" not in api["module"]
        assert "int8_calibrator" not in api["classes"]["IBuilderConfig"]["attrs"]


@pytest.mark.parametrize("major", sorted(RELEASES))
def test_what_the_emulation_offers_exists_in_the_real_bindings(real_api, emulated_run, major):
    """Check (a): every public class, enum member (and value), method (and parameter names), property (writable only
    where the real one is) and constant of the emulation in that major's mode is in the real bindings; so is every
    public attribute that objects made through the emulation hold in an instance ``__dict__``."""
    run = emulated_run(major)
    assert run["api"]["version"] == RELEASES[major][1]
    assert {"Builder", "Runtime", "ICudaEngine", "IExecutionContext"} <= set(run["api"]["module"])
    assert compare_api(run["api"], real_api(major)) == []


@pytest.mark.parametrize("major", sorted(RELEASES))
def test_every_name_the_project_touches_exists_in_the_real_bindings(real_api, emulated_run, major):
    """Check (b): the names the project's builder (`engine --precision fp32`, `--precision fp16`) and runtime (a
    short generate on the tensorrt backend) read, write, construct or probe on the emulated TensorRT exist in the real
    bindings (written ones as writable properties); the run itself succeeded and the recorder saw both sides."""
    run = emulated_run(major)
    assert "error" not in run["scenario"], run["scenario"]
    assert run["scenario"]["engine_exit_codes"] == {"fp32": 0, "fp16": 0, "int8": 0, "int4": 0}
    assert len(run["scenario"]["tokens"]) == 4
    seen = {tuple(a) for a in run["accesses"]}
    assert {("Builder", "build_serialized_network", "get"), ("IBuilderConfig", "profiling_verbosity", "set"),
            ("Runtime", "__init__", "call"), ("IExecutionContext", "execute_async_v3", "get"),
            ("BuilderFlag", "TF32", "get"), ("module", "nptype", "get")} <= seen, sorted(seen)
    assert compare_accesses(run["accesses"], real_api(major)) == []


@pytest.mark.parametrize("major", sorted(RELEASES))
def test_emulated_objects_take_only_the_writes_the_real_classes_take(real_api, emulated_run, major):
    """A pybind class raises AttributeError on a write to a name it has no writable property for: the emulated objects
    accept a probed write exactly where the real class has a writable property (``layer.precision = ...`` and
    ``config.int8_calibrator = ...`` refused under 11)."""
    api, writes = real_api(major), emulated_run(major)["writes"]
    for owner, name in WRITE_PROBES:
        attr = api["classes"][owner]["attrs"].get(name, {})
        real = "accepted" if attr.get("kind") == "property" and attr.get("writable") else "AttributeError"
        assert writes[f"{owner}.{name}"] == real, (owner, name)
    if major == 11:
        assert writes["ILayer.precision"] == writes["IBuilderConfig.int8_calibrator"] == "AttributeError"


def test_the_checks_report_each_kind_of_disagreement(real_api):
    """The comparisons fail where they should, on a copy of the real 11.x API (clean against itself) with six
    disagreements put in: a renamed parameter, a wrong enum value, an enum member, class and method the real API
    lacks, a writable read-only property; and a project that writes a removed attribute (``ILayer.precision`` under
    11), constructs a class TensorRT makes itself, passes a keyword the real method does not take, or probes a name
    the emulation hides."""
    real = real_api(11)
    emu = copy.deepcopy(real)
    assert compare_api(emu, real) == []
    classes = emu["classes"]
    classes["IExecutionContext"]["attrs"]["set_tensor_address"]["sigs"] = [[["name", False], ["ptr", False]]]
    classes["BuilderFlag"]["members"]["TF32"] = 7
    classes["BuilderFlag"]["members"]["FP16"] = 0
    classes["ILayer"]["attrs"]["set_output_type"] = {"kind": "method", "sigs": [[["index", False], ["dtype", False]]]}
    classes["ILayer"]["attrs"]["type"] = {"kind": "property", "writable": True}
    emu["module"]["IInt8EntropyCalibrator2"] = {"kind": "class", "target": "IInt8EntropyCalibrator2"}
    classes["IInt8EntropyCalibrator2"] = {"enum": False, "members": {}, "constructor": [[]], "attrs": {}}
    problems = compare_api(emu, real)
    for expected in ("IExecutionContext.set_tensor_address(name, ptr): the real parameters are (name, memory)",
                     "BuilderFlag.TF32 = 7, the real value is 6", "BuilderFlag.FP16: no such enum member",
                     "ILayer.set_output_type: not in the real bindings", "ILayer.type: writable here, read-only",
                     "tensorrt.IInt8EntropyCalibrator2: not in the real bindings"):
        assert any(p.startswith(expected) for p in problems), (expected, problems)
    assert len(problems) == 6, problems
    problems = compare_accesses([("ILayer", "precision", "set"), ("ICudaEngine", "__init__", "call"),
                                 ("IExecutionContext", "set_device_memory", "missing"),
                                 ("ILayer", "name", "set"), ("module", "Builder", "get"),
                                 ("IExecutionContext", "set_tensor_address", "keyword ptr"),
                                 ("IExecutionContext", "set_tensor_address", "keyword memory"),
                                 ("Logger", "__init__", "keyword min_severity")], real)
    assert problems == [
        "ICudaEngine(): the project constructs it; the real class has no Python constructor",
        "IExecutionContext.set_device_memory: the project probed it and the emulation lacks it, the real bindings "
        "have it",
        "IExecutionContext.set_tensor_address: the project passes ptr=, the real signatures are (name, memory)",
        "ILayer.precision: the project sets it; not in the real bindings"], problems
