"""Read a TensorRT Python API (the real ``tensorrt_bindings`` or the EMULATED ``tensorrt`` of tests/emulated), record
the TensorRT names the project touches, and compare both with the real API (tests/test_trt_real_bindings.py).

Run as a script in a subprocess, one per release:

* ``python trt_api.py real OUT``: import ``tensorrt_bindings`` (the real bindings wheel, on ``sys.path`` with the stub
  libraries on ``LD_LIBRARY_PATH``) and write its API as JSON to OUT.
* ``python trt_api.py emulated OUT ARTIFACT``: import the emulated ``tensorrt`` (``EMULATED_TENSORRT_VERSION`` picks
  its mode), write its API, then record every attribute the project's code (``medusa_export``, ``medusa_runtime``)
  reads, writes, calls or probes on it while building fp32, fp16, int8 and int4 (Q/DQ) engines of ARTIFACT and
  generating with the
  tensorrt backend.

An API is ``{"version", "module": {name: entry}, "classes": {qualname: class}}``: a module entry is a class
reference, a function (its signatures) or a constant (its int value); a class has its enum members (name -> int),
its constructor's signatures (None: not constructible from Python), and its attributes (method with signatures,
property with writability, constant, nested class). A signature is a list of ``[name, has_default]``, without
``self``; the real bindings' come from the pybind signature lines of their docstrings (one per overload).
"""

from __future__ import annotations

import enum
import inspect
import json
import re
import sys
import types
from pathlib import Path

#: Modules whose code counts as the project's when it touches TensorRT.
PROJECT_PACKAGES = ("medusa_export", "medusa_runtime")
#: Where names a class inherits from these come from Python or pybind11 itself, not from TensorRT's API.
_BUILTIN_MODULES = ("builtins", "enum", "pybind11_builtins")


def is_private(name: str) -> bool:
    """Whether ``name`` is emulator-only or private, left out of the comparison: ``_x``, ``emulator_*``,
    ``EMULATED``, ``PLAN_MAGIC`` (the emulated plan's header line).

    Args:
        name: a module or class attribute name.

    Returns:
        True for those names.
    """
    return name.startswith("_") or name.startswith("emulator_") or name in ("EMULATED", "PLAN_MAGIC")


# ---------------------------------------------------------------- reading an API


def _split_params(text: str) -> list[str]:
    """Split a pybind parameter list at its top-level commas (types and defaults nest brackets)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def pybind_signatures(doc: str | None, name: str) -> list[list]:
    """The signatures in a pybind docstring: one per ``name(...) -> ...`` line (overloads numbered ``1. ...``).

    Args:
        doc: the docstring (None: no signature).
        name: the function's name as the signature lines spell it.

    Returns:
        One list of [parameter, has_default] per signature, without ``self``; the ``(*args, **kwargs)`` header line
        of an overloaded function is dropped.
    """
    sigs = []
    for line in (doc or "").splitlines():
        m = re.match(rf"^(?:\d+\. )?{re.escape(name)}\((.*)\)\s*(?:->.*)?$", line.strip())
        if not m:
            continue
        params = [[p.split(":")[0].split("=")[0].strip(), "=" in p] for p in _split_params(m.group(1))]
        if params and params[0][0] == "self":
            params = params[1:]
        if [p for p, _ in params] == ["*args", "**kwargs"]:
            continue
        sigs.append(params)
    return sigs


def _python_signature(fn, drop_self: bool) -> list[list]:
    params = list(inspect.signature(fn).parameters.values())
    if drop_self and params:
        params = params[1:]
    star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return [[star.get(p.kind, "") + p.name, p.default is not inspect.Parameter.empty] for p in params]


def _is_pybind(obj) -> bool:
    return type(obj).__name__ in ("instancemethod", "builtin_function_or_method", "pybind11_static_property")


def _signatures(obj, name: str, drop_self: bool) -> list[list]:
    if _is_pybind(obj):
        return pybind_signatures(obj.__doc__, name)
    return [_python_signature(obj, drop_self)]


def _is_enum(cls) -> bool:
    return isinstance(cls, type) and (issubclass(cls, enum.Enum) or hasattr(cls, "__members__"))


def _defined_in_builtins(cls, name: str) -> bool:
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass.__module__ in _BUILTIN_MODULES
    return False


def _constructor(cls):
    """The constructor's signatures; None where the class has no constructor of its own (pybind's default
    ``__init__`` refuses: "No constructor defined"; a Python class inheriting ``object``'s or a builtin's)."""
    init = inspect.getattr_static(cls, "__init__")
    if _is_pybind(init):
        return pybind_signatures(init.__doc__, "__init__")
    if isinstance(init, types.FunctionType) and init.__module__ not in _BUILTIN_MODULES:
        return [_python_signature(init, True)]
    return None


def _dump_class(cls, qualname: str, classes: dict) -> None:
    members = {k: int(v) for k, v in cls.__members__.items()} if _is_enum(cls) else {}
    attrs = {}
    for name in dir(cls):
        if is_private(name) or name in members or _defined_in_builtins(cls, name):
            continue
        a = inspect.getattr_static(cls, name)
        if isinstance(a, property):
            attrs[name] = {"kind": "property", "writable": a.fset is not None}
        elif type(a).__name__ == "member_descriptor":  # a __slots__ attribute: readable and writable
            attrs[name] = {"kind": "property", "writable": True}
        elif isinstance(a, (staticmethod, classmethod)):
            attrs[name] = {"kind": "method", "sigs": _signatures(a.__func__, name, isinstance(a, classmethod))}
        elif isinstance(a, types.FunctionType) or _is_pybind(a):
            bound = type(a).__name__ != "builtin_function_or_method"  # a pybind static method has no self
            attrs[name] = {"kind": "method", "sigs": _signatures(a, name, bound)}
        elif isinstance(a, type):
            attrs[name] = {"kind": "class", "target": f"{qualname}.{name}"}
            if f"{qualname}.{name}" not in classes:
                _dump_class(a, f"{qualname}.{name}", classes)
        elif isinstance(a, int) or hasattr(a, "__int__"):
            attrs[name] = {"kind": "constant", "value": int(a)}
        else:
            attrs[name] = {"kind": "other", "type": type(a).__name__}
    classes[qualname] = {"enum": _is_enum(cls), "members": members, "constructor": _constructor(cls),
                         "attrs": attrs}


def dump_api(module) -> dict:
    """The public API of a TensorRT module (see the module docstring): its classes, enums with their values,
    methods with their parameter names, properties with their writability, functions and constants.

    Args:
        module: ``tensorrt_bindings`` (real) or the emulated ``tensorrt``.

    Returns:
        A JSON-serialisable dict.
    """
    out, classes = {}, {}
    home = (module.__name__, f"{module.__name__}.tensorrt")
    for name in dir(module):
        if is_private(name):
            continue
        obj = getattr(module, name)
        if isinstance(obj, type):
            if obj.__module__ not in home:
                continue  # imported helpers (pathlib.Path, ...)
            out[name] = {"kind": "class", "target": name}
            _dump_class(obj, name, classes)
        elif callable(obj) and not isinstance(obj, enum.Enum) and getattr(obj, "__module__", None) in home:
            out[name] = {"kind": "function", "sigs": _signatures(obj, name, False)}
        elif isinstance(obj, enum.Enum) or type(getattr(obj, "__class__", None)).__name__ == "pybind11_type":
            out[name] = {"kind": "constant", "value": int(obj)}
    return {"version": module.__version__, "module": out, "classes": classes}


# ---------------------------------------------------------------- recording what the project touches


def _from_project(frame) -> bool:
    return frame.f_globals.get("__name__", "").split(".")[0] in PROJECT_PACKAGES


def install_recorder(module) -> set:
    """Record, from now on, every public name the project's code reads (``get``), writes (``set``), calls as a
    constructor (``call``) or looks up in vain (``missing``: a ``hasattr`` probe) on ``module``, on its classes and
    on their instances, and each keyword it passes to a method or constructor (``keyword NAME``). Accesses made by
    the module's own code are not recorded.

    Each public class is replaced, in the module, by a same-named subclass with a recording metaclass and
    ``__getattribute__`` / ``__setattr__`` (so the module's own code creates recorded instances too); enums get a
    recording metaclass in place; the module gets a recording module type.

    Args:
        module: the emulated ``tensorrt``.

    Returns:
        The set of (owner, name, how) it fills: owner "module" or a class's name.
    """
    log: set = set()

    def note(frame, owner: str, name: str, how: str) -> None:
        if _from_project(frame) and (not name.startswith("__") or name == "__init__"):
            log.add((owner, name, how))

    def recording_meta(meta, owner: str):
        class Meta(meta):
            def __getattribute__(cls, name):
                try:
                    value = meta.__getattribute__(cls, name)
                except AttributeError:
                    note(sys._getframe(1), owner, name, "missing")
                    raise
                note(sys._getframe(1), owner, name, "get")
                return value

            def __call__(cls, *args, **kwargs):
                if not issubclass(meta, enum.EnumMeta):
                    for how in ("call", *(f"keyword {k}" for k in kwargs)):
                        note(sys._getframe(1), owner, "__init__", how)
                return meta.__call__(cls, *args, **kwargs)

        return Meta

    def recording_class(cls):
        owner = cls.__name__
        base_get, base_set = cls.__getattribute__, cls.__setattr__

        def __getattribute__(self, name):
            try:
                value = base_get(self, name)
            except AttributeError:
                note(sys._getframe(1), owner, name, "missing")
                raise
            frame = sys._getframe(1)
            note(frame, owner, name, "get")
            if isinstance(value, types.MethodType) and _from_project(frame):
                def keywords(*args, **kwargs):
                    for k in kwargs:
                        note(sys._getframe(1), owner, name, f"keyword {k}")
                    return value(*args, **kwargs)

                return keywords
            return value

        def __setattr__(self, name, value):
            note(sys._getframe(1), owner, name, "set")
            base_set(self, name, value)

        ns = {"__slots__": (), "__module__": cls.__module__, "__qualname__": cls.__qualname__,
              "__getattribute__": __getattribute__, "__setattr__": __setattr__, "__doc__": cls.__doc__}
        return recording_meta(type(cls), owner)(owner, (cls,), ns)

    replaced = {}
    for name in dir(module):
        obj = getattr(module, name)
        if is_private(name) or not isinstance(obj, type) or obj.__module__ != module.__name__:
            continue
        if issubclass(obj, enum.Enum):
            if type(obj).__name__ != "Meta":
                obj.__class__ = recording_meta(type(obj), obj.__name__)
        else:
            if id(obj) not in replaced:
                replaced[id(obj)] = recording_class(obj)
            setattr(module, name, replaced[id(obj)])

    class Module(types.ModuleType):
        def __getattribute__(self, name):
            try:
                value = types.ModuleType.__getattribute__(self, name)
            except AttributeError:
                note(sys._getframe(1), "module", name, "missing")
                raise
            note(sys._getframe(1), "module", name, "get")
            return value

    module.__class__ = Module
    return log


# ---------------------------------------------------------------- comparing with the real API


def _sig_matches(emulated: list, real_sigs: list[list]) -> bool:
    """An emulated signature matches a real overload when its parameter names are that overload's leading names in
    order and every real parameter it leaves out has a default."""
    names = [p for p, _ in emulated]
    return any(names == [p for p, _ in r[:len(names)]] and all(d for _, d in r[len(names):]) for r in real_sigs)


def _fmt(sigs) -> str:
    return " | ".join("(" + ", ".join(p for p, _ in s) + ")" for s in sigs)


def compare_api(emulated: dict, real: dict) -> list[str]:
    """What the emulated API offers that the real one lacks or spells differently (check (a)).

    Every public module name, class, enum member (with its value), method (with its parameter names), property
    (writable only where the real one is) and class constant (with its value) of ``emulated`` must be in ``real``.
    A constructor is compared where the real class has one; where it has none, the emulated ``__init__`` is the
    emulation's own way to make the object (TensorRT makes it in C++) and is left out.

    Args:
        emulated: :func:`dump_api` of the emulated module.
        real: :func:`dump_api` of the real bindings.

    Returns:
        One line per disagreement (empty: none).
    """
    problems = []
    for name, entry in sorted(emulated["module"].items()):
        problems += _compare_entry(f"tensorrt.{name}", entry, real["module"].get(name), emulated, real)
    return problems


def _compare_entry(where: str, e: dict, r: dict | None, emulated: dict, real: dict) -> list[str]:
    """The disagreements of one emulated entry ``e`` (module name or class attribute) with the real one ``r``."""
    if r is None:
        return [f"{where}: not in the real bindings"]
    if e["kind"] != r["kind"]:
        return [f"{where}: a {e['kind']} here, a {r['kind']} in the real bindings"]
    if e["kind"] in ("function", "method") and not all(_sig_matches(s, r["sigs"]) for s in e["sigs"]):
        return [f"{where}{_fmt(e['sigs'])}: the real parameters are {_fmt(r['sigs'])}"]
    if e["kind"] == "property" and e["writable"] and not r["writable"]:
        return [f"{where}: writable here, read-only in the real bindings"]
    if e["kind"] == "constant" and e["value"] != r["value"]:
        return [f"{where} = {e['value']}, the real value is {r['value']}"]
    if e["kind"] == "class":
        return _compare_class(where.removeprefix("tensorrt."), emulated["classes"][e["target"]], emulated, real,
                              real["classes"][r["target"]])
    return []


def _compare_class(name: str, emu: dict, emulated: dict, real: dict, rc: dict) -> list[str]:
    problems = []
    for m, v in sorted(emu["members"].items()):
        if m not in rc["members"]:
            problems.append(f"{name}.{m}: no such enum member in the real bindings")
        elif rc["members"][m] != v:
            problems.append(f"{name}.{m} = {v}, the real value is {rc['members'][m]}")
    if emu["constructor"] is not None and rc["constructor"] is not None and not all(
            _sig_matches(s, rc["constructor"]) for s in emu["constructor"]):
        problems.append(f"{name}{_fmt(emu['constructor'])}: the real constructor takes {_fmt(rc['constructor'])}")
    for a, e in sorted(emu["attrs"].items()):
        problems += _compare_entry(f"{name}.{a}", e, rc["attrs"].get(a), emulated, real)
    return problems


def compare_accesses(accesses: list, real: dict) -> list[str]:
    """The recorded names the real API lacks (check (b)).

    ``get``: the name exists (module name, class attribute or enum member); ``set``: a writable property;
    ``call``: the class has a Python constructor; ``keyword K``: a signature of the real method (constructor) has a
    parameter K; ``missing`` (the emulation lacked a name the project probed): the real bindings lack it too, else
    the project takes another path on the emulation than on TensorRT.

    Args:
        accesses: (owner, name, how) triples of :func:`install_recorder`.
        real: :func:`dump_api` of the real bindings.

    Returns:
        One line per problem (empty: none).
    """
    problems = []
    for owner, name, how in sorted(map(tuple, accesses)):
        if owner == "module":
            found = name in real["module"]
            where = f"tensorrt.{name}"
        else:
            rc = real["classes"].get(owner)
            if rc is None:
                problems.append(f"{owner}: the project uses a class the real bindings lack")
                continue
            found = name in rc["attrs"] or name in rc["members"] or (name == "__init__")
            attr = rc["attrs"].get(name, {})
            where = f"{owner}.{name}"
            if how == "set" and found and not (attr.get("kind") == "property" and attr.get("writable")):
                problems.append(f"{where}: the project writes it; the real bindings have no writable property")
            if how == "call" and rc["constructor"] is None:
                problems.append(f"{owner}(): the project constructs it; the real class has no Python constructor")
            if how.startswith("keyword "):
                sigs = (rc["constructor"] if name == "__init__" else attr.get("sigs")) or []
                if not any(how[8:] in [p for p, _ in sig] for sig in sigs):
                    problems.append(f"{where}: the project passes {how[8:]}=, the real signatures are {_fmt(sigs)}")
        if how == "missing" and found:
            problems.append(f"{where}: the project probed it and the emulation lacks it, the real bindings have it")
        elif how != "missing" and not found:
            problems.append(f"{where}: the project {how}s it; not in the real bindings")
    return problems


# ---------------------------------------------------------------- the subprocesses


def _scenario(artifact: str) -> dict:
    """Build fp32, fp16 and the Q/DQ int8 / int4 engines of ``artifact`` (the graphs ``build --graph portable
    --precision int8|int4`` writes: plans from explicit Q/DQ, no precision flag) and generate a few tokens with the
    tensorrt backend."""
    from medusa_export.cli.main import main
    from medusa_runtime.front.session import MedusaSession

    codes = {p: main(["engine", "--artifact", artifact, "--precision", p]) for p in ("fp32", "fp16")}
    codes.update({p: main(["engine", "--artifact", artifact, "--precision", p, "--no-validate"]) for p in ("int8", "int4")})
    session = MedusaSession(artifact, backend="tensorrt", tree="artifact", precision="fp16", notice=None)
    tokens = session.generate(prompt_ids=[3, 17, 42, 5], max_new_tokens=4).token_ids
    session.close()
    return {"engine_exit_codes": codes, "tokens": list(map(int, tokens))}


#: Attribute writes tried on emulated objects: (object, attribute). Whether each is accepted is compared with the
#: real class's writable properties: a pybind class raises AttributeError for any other name.
WRITE_PROBES = (("ILayer", "precision"), ("ILayer", "name"), ("ILayer", "type"), ("ILayer", "no_such_attribute"),
                ("IUnaryLayer", "op"), ("ITensor", "dtype"), ("ITensor", "name"), ("ITensor", "no_such_attribute"),
                ("IBuilderConfig", "int8_calibrator"), ("IBuilderConfig", "profiling_verbosity"),
                ("IBuilderConfig", "flags_set"), ("INetworkDefinition", "strongly_typed"),
                ("INetworkDefinition", "num_layers"), ("Logger", "min_severity"), ("Logger", "no_such_attribute"),
                ("IOptimizationProfile", "shapes"), ("OnnxParser", "network"))


def _probe_objects(trt, folder: Path) -> dict:
    """Objects made through the emulated API (a builder, a config, a profile, a parsed one-Exp ONNX graph's network,
    layer and tensor), by the names of :data:`WRITE_PROBES`."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Exp", ["x"], ["y"], name="exp")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = folder / "probe.onnx"
    onnx.save(helper.make_model(graph), str(path))
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(path))
    return {"ILayer": network.get_layer(0), "IUnaryLayer": network.get_layer(0), "ITensor": network.get_input(0),
            "IBuilderConfig": builder.create_builder_config(), "INetworkDefinition": network, "Logger": logger,
            "IOptimizationProfile": builder.create_optimization_profile(), "OnnxParser": parser, "Builder": builder}


def add_instance_attributes(api: dict, objects: dict) -> None:
    """Add to ``api`` the public attributes that ``objects`` hold in an instance ``__dict__`` (a class without
    ``__slots__`` offers them, and a class-level dump cannot see them), as writable properties of their classes.

    Args:
        api: :func:`dump_api` of the module the objects come from (changed in place).
        objects: instances of its classes.
    """
    for obj in objects.values():
        attrs = api["classes"][type(obj).__name__]["attrs"]
        for name in getattr(obj, "__dict__", {}):
            if not is_private(name):
                attrs.setdefault(name, {"kind": "property", "writable": True})


def _write_probes(objects: dict) -> dict:
    """Try :data:`WRITE_PROBES` on ``objects``; returns "object.attribute" -> "accepted" or the exception's type
    name."""
    out = {}
    for owner, name in WRITE_PROBES:
        obj = objects[owner]
        value = getattr(obj, name, None)
        try:
            setattr(obj, name, value)
            out[f"{owner}.{name}"] = "accepted"
        except Exception as exc:  # noqa: BLE001 - the outcome is the result
            out[f"{owner}.{name}"] = type(exc).__name__
    return out


def main(argv: list[str]) -> None:
    """``real OUT`` or ``emulated OUT ARTIFACT`` (see the module docstring); the emulated run also writes
    :func:`_write_probes` and the scenario's outcome (its error, if it failed)."""
    out = Path(argv[1])
    if argv[0] == "real":
        import tensorrt_bindings

        out.write_text(json.dumps(dump_api(tensorrt_bindings), indent=1))
        return
    import tensorrt

    api, objects = dump_api(tensorrt), _probe_objects(tensorrt, out.parent)
    add_instance_attributes(api, objects)
    result = {"api": api, "writes": _write_probes(objects), "accesses": []}
    log = install_recorder(tensorrt)
    try:
        result["scenario"] = _scenario(argv[2])
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        result["scenario"] = {"error": f"{type(exc).__name__}: {exc}"}
    result["accesses"] = sorted(log)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
