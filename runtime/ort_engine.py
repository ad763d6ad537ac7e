"""ONNX Runtime backend: the artifact's two graphs behind the loop's Engine interface."""

from __future__ import annotations

import numpy as np

from .artifact import Artifact
from .loop import StepResult

_NP = {"float32": np.float32, "float16": np.float16}


class OrtEngine:
    """Runs ``model.onnx`` (backbone step) and ``heads.onnx`` with ONNX Runtime.

    Args:
        artifact: a loaded artifact.
        providers: ONNX Runtime execution providers (default: CPU).
        threads: intra-op threads (default: ONNX Runtime's choice).
    """

    def __init__(self, artifact: Artifact, providers: list[str] | None = None, threads: int | None = None):
        import onnxruntime as ort

        m = artifact.model
        self.num_layers = m["num_layers"]
        self.num_kv_heads = m["num_kv_heads"]
        self.head_dim = m["head_dim"]
        self.num_heads = m["medusa_heads"]
        self.kv_dtype = np.dtype(_NP[artifact.manifest["precision"]["kv_dtype"]])
        self.hidden_dtype = self.kv_dtype
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
        providers = providers or ["CPUExecutionProvider"]
        self.step_session = ort.InferenceSession(str(artifact.file("model")), opts, providers=providers)
        self.heads_session = ort.InferenceSession(str(artifact.file("heads")), opts, providers=providers)
        self._past_names = [(f"past_key_values.{i}.key", f"past_key_values.{i}.value") for i in range(self.num_layers)]
        self._outputs = [o.name for o in self.step_session.get_outputs()]

    def step(self, input_ids, position_ids, mask, temperature, past) -> StepResult:
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
        return self.heads_session.run(None, {"hidden_states": np.ascontiguousarray(hidden, self.hidden_dtype)})[0]
