"""ONNX Runtime backend (CPU): the artifact's two graphs behind the loop's Engine interface.

The KV cache is the loop's numpy :class:`~medusa_runtime.loop.KVCache`: the past is fed
as views of its valid prefix (no copy), the step returns only the S new K/V rows.

Measured and not kept (2 shared CPU cores, embedded model, T = 64 and T = 1 at past 256):
``run_with_iobinding`` with the inputs bound from the cache views and the new K/V bound
straight into the cache slots (saving the allocation of the [1, S, H_kv, D] outputs and
the compaction copy) was within the run-to-run noise of plain ``run`` (a few hundred KB
per step against tens of ms of compute), so the simpler ``run`` stays. The GPU engine
(:mod:`medusa_runtime.ort_cuda`) binds, where the host/device copies would matter.
"""

from __future__ import annotations

import numpy as np

from .artifact import Artifact
from .errors import ArtifactError
from .loop import StepResult

#: manifest ``precision.kv_dtype`` -> numpy dtype of the K/V and hidden-state tensors.
KV_DTYPES = {"float32": np.float32, "float16": np.float16}


def session_options(threads: int | None, spin: bool = False):
    """ONNX Runtime session options: quiet logs, ``threads`` intra-op threads (None: ORT's default).

    ``spin=False`` stops the intra-op threads from busy-waiting between runs. Measured on the
    2 shared cores here (load ~5 from other processes, steps interleaved, host work between
    them): T=16 tree step 165 ms without spinning vs 266 ms with it, T=1 134 vs 150 ms. A
    spinning pool also burns the cores the host work and other processes need; pass
    ``spin=True`` on a dedicated machine.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return opts


_ORT_TYPES = {"float32": "tensor(float)", "float16": "tensor(float16)", "int64": "tensor(int64)",
              "bool": "tensor(bool)"}


def check_graph_io(session, graph: dict, path) -> None:
    """The ONNX graph's inputs/outputs must be the manifest's: names, dtypes, static dims.

    Args:
        session: an ``onnxruntime.InferenceSession``.
        graph: the manifest's ``graphs[...]`` entry (``inputs``/``outputs`` lists).
        path: the graph file (for messages).

    Raises:
        ArtifactError: a missing or extra tensor, a different dtype, or a different static
            dimension (the graph is from another build, or the manifest was edited).
    """
    actual = {a.name: a for a in session.get_inputs() + session.get_outputs()}
    expected = {t["name"]: t for t in graph["inputs"] + graph["outputs"]}
    if set(actual) != set(expected):
        missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
        raise ArtifactError(f"{path} does not match the manifest: tensors missing from the graph {missing[:3]}, "
                            f"not in the manifest {extra[:3]}")
    for name, t in expected.items():
        a = actual[name]
        same_dims = len(a.shape) == len(t["shape"]) and all(
            x == y for x, y in zip(a.shape, t["shape"]) if isinstance(x, int) and isinstance(y, int))
        if a.type != _ORT_TYPES.get(t["dtype"]) or not same_dims:
            raise ArtifactError(f"{path}: tensor {name} is {a.type} {a.shape} in the graph but "
                                f"{t['dtype']} {t['shape']} in the manifest")


class OrtEngine:
    """Runs ``model.onnx`` (backbone step) and ``heads.onnx`` with ONNX Runtime.

    Args:
        artifact: a loaded artifact.
        providers: ONNX Runtime execution providers (default: CPU).
        threads: intra-op threads (default: ONNX Runtime's choice).
        spin: let idle intra-op threads busy-wait (see :func:`session_options`).
    """

    def __init__(self, artifact: Artifact, providers: list[str] | None = None, threads: int | None = None,
                 spin: bool = False):
        import onnxruntime as ort

        m = artifact.model
        self.num_layers = m["num_layers"]
        self.num_kv_heads = m["num_kv_heads"]
        self.head_dim = m["head_dim"]
        self.num_heads = m["medusa_heads"]
        self.kv_dtype = np.dtype(KV_DTYPES[artifact.manifest["precision"]["kv_dtype"]])
        self.hidden_dtype = self.kv_dtype
        opts = session_options(threads, spin)
        providers = providers or ["CPUExecutionProvider"]
        self.step_session = ort.InferenceSession(str(artifact.file("model")), opts, providers=providers)
        self.heads_session = ort.InferenceSession(str(artifact.file("heads")), opts, providers=providers)
        for key, sess in (("model", self.step_session), ("heads", self.heads_session)):
            check_graph_io(sess, artifact.manifest["graphs"][key], artifact.file(key))
        self._past_names = [(f"past_key_values.{i}.key", f"past_key_values.{i}.value") for i in range(self.num_layers)]
        self._outputs = [o.name for o in self.step_session.get_outputs()]

    def step(self, input_ids, position_ids, mask, temperature, past) -> StepResult:
        """One step; shapes as :class:`medusa_runtime.loop.Engine` (outputs batch-dropped)."""
        feed = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "new_token_mask": mask,
            "temperature": np.array([temperature], dtype=np.float32),
        }
        for (kn, vn), (k, v) in zip(self._past_names, past):
            feed[kn], feed[vn] = k, v
        outs = self.step_session.run(self._outputs, feed)
        new = outs[5:]
        return StepResult(outs[0][0], outs[1][0], outs[2][0], outs[3][0], outs[4][0],
                          [(new[2 * i], new[2 * i + 1]) for i in range(self.num_layers)])

    def heads(self, hidden: np.ndarray, topk: int) -> np.ndarray:
        """hidden [R, d] -> int64 [R, K, topk] (topk fixed by the artifact's heads graph)."""
        return self.heads_session.run(None, {"hidden_states": np.ascontiguousarray(hidden, self.hidden_dtype)})[0]
