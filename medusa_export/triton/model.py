"""Triton Inference Server Python-backend model: Medusa generation with medusa_runtime.

This file is a template: ``medusa-export triton`` (medusa_export/triton/repository.py) copies it to
``<repository>/<model>/1/model.py`` next to a copy of the ``medusa_runtime`` package, so
the Python environment of the backend needs only the runtime's own dependencies (numpy,
onnxruntime, tokenizers, jinja2), not torch. It is never imported by medusa_export.

The model is decoupled: a request gets one response (``stream`` false) or one response
per tree step followed by a final one carrying the finish reason (``stream`` true); the
last response has the FINAL flag. A malformed request gets one response with a
``TritonError`` (INVALID_ARG) at once and the model goes on serving. Each model instance
owns one :class:`MedusaSession` and one :class:`~medusa_runtime.front.serving.BatchServer`: a
background thread whose scheduler runs up to ``batch_size`` requests in each step
(in-flight batching: a request joins at the next step boundary and leaves when it ends,
each with the tokens it would get alone). ``execute`` only checks and queues requests and
returns; the responses are sent from that thread. More instances (``instance_group.count``)
serve side by side, each with its own batch.

Inputs (all optional but one prompt; also accepted as request parameters, see
medusa_runtime/front/serving.py's FIELDS): text_input, messages, input_ids, max_new_tokens, one per sampling
setting (medusa_runtime.decode.acceptance.SAMPLING_SETTINGS, SamplingConfig's fields: temperature, acceptance,
top_k, top_p, posterior_threshold, posterior_alpha, seed), stop, stream, raw; the request parser
turns them into one SamplingConfig. Outputs: output_ids, text_output, finish_reason, num_input_tokens,
tokens_per_step.

Model parameters (config.pbtxt): artifact_dir (absolute, or relative to this file's
folder), backend (medusa_runtime engine backend), precision (for tensorrt), threads,
max_context, max_new_tokens_limit, batch_size (requests sharing a step; default
medusa_runtime.decode.batch.DEFAULT_BATCH_SIZE).
"""

import json
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path[:1] != [_HERE]:
    sys.path.insert(0, _HERE)  # the runtime copied beside this file wins over any installed one

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from medusa_runtime.decode.batch import DEFAULT_BATCH_SIZE  # noqa: E402
from medusa_runtime.errors import MedusaError  # noqa: E402
from medusa_runtime.front.serving import FIELDS, BatchServer, RequestError, merge_fields, parse_request  # noqa: E402
from medusa_runtime.front.session import MedusaSession  # noqa: E402

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _error(message: str, code_name: str):
    code = getattr(pb_utils.TritonError, code_name, None)
    err = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=err)


def _response(ids, text: str, finish_reason: str = "", prompt_tokens: int = 0, tokens_per_step: float = 0.0):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("output_ids", np.asarray(ids, dtype=np.int64).reshape(-1)),
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([finish_reason.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("num_input_tokens", np.array([prompt_tokens], dtype=np.int32)),
        pb_utils.Tensor("tokens_per_step", np.array([tokens_per_step], dtype=np.float32)),
    ])


class TritonPythonModel:
    """One Medusa session per model instance."""

    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("the medusa model must be decoupled "
                                                "(model_transaction_policy { decoupled: true })")
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        artifact = params.get("artifact_dir") or "artifact"
        if not os.path.isabs(artifact):
            artifact = os.path.join(_HERE, artifact)
        options = {}
        if params.get("precision"):
            options["precision"] = params["precision"]
        if args.get("model_instance_kind") == "GPU":
            options["device_id"] = int(args["model_instance_device_id"])
        self.session = MedusaSession(artifact, backend=params.get("backend") or "onnxruntime",
                                     threads=int(params.get("threads") or 0) or None,
                                     max_context=int(params.get("max_context") or 0) or None,
                                     tree=params.get("tree") or None, notice=pb_utils.Logger.log_info, **options)
        self.limit = int(params.get("max_new_tokens_limit") or 0) or None
        batch = int(params.get("batch_size") or 0) or DEFAULT_BATCH_SIZE
        self.server = BatchServer(self.session, batch_size=batch, log=pb_utils.Logger.log_info)
        pb_utils.Logger.log_info(f"medusa: {artifact} on {self.session.backend}, tree of {self.session.tree.size} "
                                 f"nodes ({self.session.tree_source}), context {self.session.max_context}, up to {batch} requests per step")

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        return None  # decoupled: the responses come from the batch server's thread

    def _submit(self, request):
        sender = request.get_response_sender()
        try:
            inputs = {}
            for name in FIELDS:
                tensor = pb_utils.get_input_tensor_by_name(request, name)
                if tensor is not None:
                    inputs[name] = tensor.as_numpy()
            params = json.loads(request.parameters() or "{}")
            req = parse_request(merge_fields(inputs, params), self.session, max_new_tokens_limit=self.limit)
        except RequestError as exc:
            sender.send(_error(str(exc), "INVALID_ARG"), flags=_FINAL)
            return

        def on_done(out, exc):
            if exc is not None:
                if isinstance(exc, MedusaError):
                    sender.send(_error(str(exc), "INVALID_ARG"), flags=_FINAL)
                    return
                pb_utils.Logger.log_error(f"medusa: generation failed: {exc!r}")
                sender.send(_error(f"generation failed: {exc}", "INTERNAL"), flags=_FINAL)
            elif out.finish_reason == "cancelled":
                sender.send(_error("the request was cancelled", "CANCELLED"), flags=_FINAL)
            else:
                ids, text = ([], "") if req.stream else (out.token_ids, out.text)
                sender.send(_response(ids, text, out.finish_reason, out.prompt_tokens, out.tokens_per_step),
                            flags=_FINAL)

        on_step = (lambda ids, text: sender.send(_response(ids, text))) if req.stream else None
        self.server.submit(req, on_step, on_done, getattr(request, "is_cancelled", None))

    def finalize(self):
        self.server.close()
        self.session.close()  # a device backend's KV caches and buffers (issue 24)
        self.session = None
