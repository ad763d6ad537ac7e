"""ONNX Runtime backend (CPU): the artifact's two graphs behind the loop's Engine interface.

Both KV layouts of the manifest (``kv_layout.layout``):

* ``sequence-major`` (portable and ``ort-contrib`` artifacts): the loop's numpy
  :class:`~medusa_runtime.engines.kvcache.KVCache`; the past is fed as views of its valid prefix (no
  copy), the step returns only the S new K/V rows and the cache copies the accepted ones.
* ``head-major`` (``ort-fused`` artifacts): a :class:`~medusa_runtime.engines.kvcache.HeadMajorKVCache`
  (``make_cache``); each layer's whole buffer is bound with I/O binding both as the
  ``past_key_values.{i}.*`` input and as the ``present.{i}.*`` output, so GroupQueryAttention
  writes the step's K/V into slots [P, P + S) in place; the KV bindings are made once per
  cache, and the small inputs and outputs are buffers kept per row count, bound when it changes
  (``OrtEngine._bind_rows``).

Measured and not kept (2 shared CPU cores, embedded model, T = 64 and T = 1 at past 256):
``run_with_iobinding`` with the inputs bound from the cache views and the new K/V bound
straight into the cache slots (saving the allocation of the [1, S, H_kv, D] outputs and
the compaction copy) was within the run-to-run noise of plain ``run`` (a few hundred KB
per step against tens of ms of compute), so the simpler ``run`` stays. The GPU engine
(:mod:`medusa_runtime.engines.ort_cuda`) binds, where the host/device copies would matter.
"""

from __future__ import annotations

import numpy as np

from ..contract.artifact import Artifact, kv_layout, level_graph, step_batch, step_limits
from ..errors import ArtifactError, ContextOverflowError, MedusaError
from .base import Capabilities, RowInputs, SamplerInputs, StepResult, sampler_feed
from .kvcache import HeadMajorKVCache, InPlacePast, KVCache, LayerKV
from .ort_rows import StepIO, run_rows

#: manifest ``precision.kv_dtype`` -> numpy dtype of the K/V and hidden-state tensors.
KV_DTYPES = {"float32": np.float32, "float16": np.float16}


def session_options(threads: int | None, spin: bool = False):
    """ONNX Runtime session options: quiet logs, ``threads`` intra-op threads (None: ORT's default).

    ``spin=False`` stops the intra-op threads from busy-waiting between runs. Measured on the
    2 shared cores here (load ~5 from other processes, steps interleaved, host work between
    them): T=16 tree step 165 ms without spinning vs 266 ms with it, T=1 134 vs 150 ms. A
    spinning pool also burns the cores the host work and other processes need; pass
    ``spin=True`` on a dedicated machine: there a waking thread costs more than the work of a small operator
    (the embedded int4 model's plain step inside the decode loop 11.2-11.7 ms without spinning, 7.5-8.0 ms with
    it; its 2-node chain step 11.4-11.9 ms + 0.9 ms of heads against 8.3-8.7 + 1.2 ms: ``scripts/bench_step_overhead.py
    I4 --sizes 1 2 --prompts 2 --max-new-tokens 64 [--spin]``, processes alternated, 2-core EPYC VM, 2026-12-07
    16:52 UTC, alone; :class:`OrtEngine` spins only its step session, see there).
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    return opts


#: The step outputs the loop reads (the K/V follow them).
_STEP_OUTPUTS = ("topk_ids", "topk_logprobs", "entropy", "token_logprobs", "hidden_states")


def pad_rows(input_ids, position_ids, mask, sampling: SamplerInputs | None, rows: int):
    """A step padded to ``rows`` rows: each extra row repeats the last token one position further on, sees the
    real rows and itself, and is seen by none (so the real rows compute exactly what they would alone, given
    row-independent kernels) and is never sampled.

    Args:
        input_ids, position_ids: int64 [1, S]; mask: bool [S, S]; sampling: the in-graph sampler's inputs or None.
        rows: the padded row count R > S.

    Returns:
        (input_ids [1, R], position_ids [1, R], mask [R, R], sampling with uniforms [R] (-1: not sampled) or None).
    """
    s = int(input_ids.shape[1])
    extra = rows - s
    ids = np.concatenate([input_ids, np.repeat(input_ids[:, -1:], extra, axis=1)], axis=1)
    pos = np.concatenate([position_ids, position_ids[:, -1:] + np.arange(1, extra + 1)], axis=1)
    m = np.zeros((rows, rows), dtype=bool)
    m[:s, :s] = mask
    m[s:, :] = np.tril(np.ones((extra, rows), dtype=bool), k=s)
    if sampling is not None:
        sampling = sampling._replace(uniforms=np.concatenate([np.asarray(sampling.uniforms, np.float32),
                                                              np.full(extra, -1.0, np.float32)]))
    return ids, pos, m, sampling


def first_rows(out: StepResult, s: int) -> StepResult:
    """The first ``s`` rows of a padded step's result (views; the K/V of the padding rows are dropped)."""
    new_kv = out.new_kv.rows(s) if isinstance(out.new_kv, LayerKV) else [(k[:, :s], v[:, :s]) for k, v in out.new_kv]
    return StepResult(out.topk_ids[:s], out.topk_logprobs[:s], out.entropy[:s], out.token_logprobs[:s, :s],
                      out.hidden[:s], new_kv,
                      None if out.sampled_ids is None else out.sampled_ids[:s])


#: Row counts whose step inputs and outputs keep their buffers (:meth:`OrtEngine._bind_rows`): every tree size the
#: runtime times (1..64 nodes); longer steps are prefills.
KEPT_ROWS = 64


class _RowBuffers:
    """The step's small inputs (name -> array) and host outputs (in ``_host_outputs`` order; None until the first
    step of that row count has run) of one row count, bound by :meth:`OrtEngine._bind_rows`."""

    def __init__(self, inputs: dict[str, np.ndarray]):
        self.inputs = inputs
        self.outputs: list[np.ndarray] | None = None


class OrtEngine:
    """Runs ``model.onnx`` (backbone step) and ``heads.onnx`` (or, for path-conditioned heads, the level
    graphs ``heads_level{j}.onnx``) with ONNX Runtime.

    Args:
        artifact: a loaded artifact.
        providers: ONNX Runtime execution providers (default: CPU).
        threads: intra-op threads (default: ONNX Runtime's choice).
        spin: let the step session's idle intra-op threads busy-wait (see :func:`session_options`; faster on a
            dedicated machine, slower on a busy one; the heads sessions never spin).
        profile_prefix: write an ONNX Runtime profile of the step graph (per-node times) to
            ``<profile_prefix>_<date>.json``; ``step_session.end_profiling()`` closes it and returns the path.
        session_config: extra ONNX Runtime session config entries (e.g. ``{"session.disable_prepacking": "1"}``,
            which the exporter's validation sets for float32 graphs: the weights then stay in the mapped
            weights file instead of pre-packed copies).
    """

    def __init__(self, artifact: Artifact, providers: list[str] | None = None, threads: int | None = None,
                 spin: bool = False, profile_prefix: str | None = None, session_config: dict[str, str] | None = None):
        import onnxruntime as ort

        m = artifact.model
        self.num_layers = m.num_layers
        self.num_kv_heads = m.num_kv_heads
        self.head_dim = m.head_dim
        self.num_heads = m.medusa_heads
        self.kv_dtype = np.dtype(KV_DTYPES[artifact.manifest.precision.kv_dtype])
        self.hidden_dtype = self.kv_dtype
        #: whether the step session's idle threads busy-wait (the heads sessions' never do, see below)
        self.spin = bool(spin)
        opts, heads_opts = session_options(threads, spin), session_options(threads, False)
        for key, value in (session_config or {}).items():
            opts.add_session_config_entry(key, value)
            heads_opts.add_session_config_entry(key, value)
        providers = providers or ["CPUExecutionProvider"]
        head_type = artifact.head_type
        heads_keys = ([level_graph(j) for j in range(1, self.num_heads + 1)] if head_type == "hydra"
                      else ["heads"])
        # The heads never spin: each session has its own thread pool, and a spinning heads pool fights the spinning
        # step pool for the cores (embedded int4 model, 2-core EPYC VM, an ad hoc loop of two-row steps and heads
        # calls, processes alternated, 2026-12-07 16:44 UTC: both spinning 9.4-14.3 ms a step, neither 6.7-6.8 ms,
        # the step's alone 4.7-6.0 ms).
        heads_sessions = {key: ort.InferenceSession(str(artifact.file(key)), heads_opts, providers=providers)
                          for key in heads_keys}
        self.heads_session = heads_sessions.get("heads")
        self.level_sessions = [heads_sessions[key] for key in heads_keys] if head_type == "hydra" else []
        if profile_prefix:
            opts.enable_profiling = True
            opts.profile_file_prefix = profile_prefix
        self.step_session = ort.InferenceSession(str(artifact.file("model")), opts, providers=providers)
        self._heads_outputs = [o.name for o in self.heads_session.get_outputs()] if self.heads_session else []
        self.step_io = StepIO.of(self.step_session, self.num_layers)
        self.kv_layout = kv_layout(artifact.manifest)
        self.max_positions = int(m.max_context)
        limits = step_limits(artifact.manifest)
        #: the batch size a batched step graph was built for (manifest ``batch``), 0 for a batch-1 graph
        self.max_batch = step_batch(artifact.manifest)
        self.capabilities = Capabilities.with_limits(
            limits, head_type=head_type, heads_logprobs="medusa_topk_logprobs" in self._heads_outputs,
            sampler=limits.has_sampler, own_cache=True)
        self._host_outputs = _STEP_OUTPUTS + (("sampled_ids",) if limits.has_sampler else ())
        self._binding = None  # (cache, IOBinding) of the head-major cache bound last
        self._bound_rows = None
        self._rows: dict[int, _RowBuffers] = {}  # row count -> its small inputs' and outputs' buffers (_bind_rows)

    def make_cache(self, capacity: int):
        """A KV cache of ``capacity`` slots in this artifact's layout.

        Raises:
            ContextOverflowError: a head-major cache larger than the artifact's max context
                (the fused graph's rotary tables end there).
        """
        if self.kv_layout == "sequence-major":
            return KVCache(self.num_layers, self.num_kv_heads, self.head_dim, capacity, self.kv_dtype)
        if capacity > self.max_positions:
            raise ContextOverflowError(f"a {capacity}-slot KV cache exceeds this artifact's max context "
                                       f"{self.max_positions}")
        return HeadMajorKVCache(self.num_layers, self.num_kv_heads, self.head_dim, capacity, self.kv_dtype)

    def _sampler_feed(self, s: int, sampling: SamplerInputs | None) -> dict:
        if not self.capabilities.sampler:
            if sampling is not None:
                raise ArtifactError("this artifact's step graph has no in-graph sampler (manifest step_sampler)")
            return {}
        return sampler_feed(s, sampling)

    def step(self, input_ids, position_ids, mask, temperature, past, sampling: SamplerInputs | None = None) -> StepResult:
        """One step; shapes as :class:`medusa_runtime.engines.base.Engine` (outputs batch-dropped).

        ``sampling`` feeds the in-graph sampler (artifacts whose manifest has ``step_sampler``);
        ``StepResult.sampled_ids`` is then its draw per row. A batched step graph (manifest ``batch``)
        runs this one sequence as a batch of one (``past_sequence_length`` = its whole past).

        A step of fewer rows than ``capabilities.min_rows`` (the manifest's ``precision.step_rows``) runs padded
        (:func:`pad_rows`) and returns its real rows only, so that every row goes through the kernels' multi-row
        path; a step whose padding would not fit the in-place cache runs as it is.
        """
        s, want = int(input_ids.shape[1]), self.capabilities.min_rows
        if s >= want or (isinstance(past, InPlacePast) and past[1] + want > past[0].capacity):
            return self._step(input_ids, position_ids, mask, temperature, past, sampling)
        ids, pos, m, smp = pad_rows(input_ids, position_ids, mask, sampling, want)
        return first_rows(self._step(ids, pos, m, temperature, past, smp), s)

    def _step(self, input_ids, position_ids, mask, temperature, past, sampling: SamplerInputs | None = None) -> StepResult:
        if isinstance(past, InPlacePast):
            if self.max_batch:  # a batched fused graph: it reads the buffers and returns the new K/V
                if sampling is not None:
                    raise ArtifactError("a batched step graph has no in-graph sampler: sample on the host")
                return run_rows(self.step_session, self.step_io, [past.cache],
                                [RowInputs(input_ids[0], position_ids[0], mask, temperature, None)])[0]
            return self._step_in_place(input_ids, position_ids, mask, temperature, past, sampling)
        feed = {
            "input_ids": input_ids,
            "position_ids": position_ids,
            "new_token_mask": mask,
            "temperature": np.array([temperature], dtype=np.float32),
            **self._sampler_feed(int(input_ids.shape[1]), sampling),
        }
        for (kn, vn), (k, v) in zip(self.step_io.past_names, past):
            feed[kn], feed[vn] = k, v
        if self.max_batch:
            feed["new_token_mask"] = mask[None]
            feed["past_sequence_length"] = np.array([past[0][0].shape[1]], dtype=np.int32)
        names = self.step_io
        outs = dict(zip(names.outputs, self.step_session.run(names.outputs, feed)))
        new = [outs[names.outputs[i]] for i in names.kv_outputs]
        sampled = outs["sampled_ids"][0] if sampling is not None else None
        return StepResult(outs["topk_ids"][0], outs["topk_logprobs"][0], outs["entropy"][0], outs["token_logprobs"][0],
                          outs["hidden_states"][0], [(new[2 * i], new[2 * i + 1]) for i in range(self.num_layers)],
                          sampled)

    def _bind_cache(self, cache: HeadMajorKVCache):
        """The I/O binding of ``cache``: each layer's buffer as past input and present output."""
        if self._binding is not None and self._binding[0] is cache:
            return self._binding[1]
        io = self.step_session.io_binding()
        for name in self._host_outputs:  # first, so that they lead get_outputs()
            io.bind_output(name)
        dtype = self.kv_dtype.type
        for i, (kn, vn) in enumerate(self.step_io.past_names):
            for name, out, buf in ((kn, f"present.{i}.key", cache.keys[i]), (vn, f"present.{i}.value", cache.values[i])):
                io.bind_input(name, "cpu", 0, dtype, list(buf.shape), buf.ctypes.data)
                io.bind_output(out, "cpu", 0, dtype, list(buf.shape), buf.ctypes.data)
        self._binding = (cache, io)
        self._bound_rows = None  # (rows, preallocated?) of the host outputs bound to ``io`` now
        return io

    def _step_in_place(self, input_ids, position_ids, mask, temperature, past: InPlacePast,
                       sampling: SamplerInputs | None = None) -> StepResult:
        cache, p = past
        s = int(input_ids.shape[1])
        if p + s > cache.capacity:
            raise ContextOverflowError(f"a step of {s} tokens does not fit: {p} of {cache.capacity} cache slots are in use")
        io = self._bind_cache(cache)
        feeds = {"input_ids": np.ascontiguousarray(input_ids, np.int64),
                 "position_ids": np.ascontiguousarray(position_ids, np.int64),
                 "new_token_mask": np.ascontiguousarray(mask, bool),
                 "temperature": np.array([temperature], dtype=np.float32),
                 "past_sequence_length": np.array([p], dtype=np.int32),
                 **self._sampler_feed(s, sampling)}
        buffers = self._bind_rows(io, s, feeds)
        self.step_session.run_with_iobinding(io)
        if buffers.outputs is None:  # the first step of S rows: ONNX Runtime allocated the outputs; keep ones like them
            outs = io.get_outputs()
            arrays = [outs[j].numpy() for j in range(len(self._host_outputs))]
            buffers.outputs = [np.empty_like(a) for a in arrays]
        else:
            arrays = [b.copy() for b in buffers.outputs]  # the next step of S rows writes into the same buffers
        topk_ids, topk_lp, entropy, token_lp, hidden = (a[0] for a in arrays[:len(_STEP_OUTPUTS)])
        sampled = arrays[len(_STEP_OUTPUTS)][0] if sampling is not None else None
        return StepResult(topk_ids, topk_lp, entropy, token_lp, hidden, cache.new_kv(p, s), sampled)

    def _bind_rows(self, io, s: int, feeds: dict[str, np.ndarray]) -> "_RowBuffers":
        """The small inputs and outputs of a step of ``s`` rows, bound to buffers kept per row count.

        A step copies ``feeds`` into its row count's input buffers; the buffers (and the outputs') are bound only
        when the row count changes. Only row counts up to :data:`KEPT_ROWS` keep theirs: a prefill of S rows binds
        fresh ones every time (prompt lengths vary, and keeping each length's [S, S] buffers would grow without
        bound). The first step of ``s`` rows leaves the outputs unallocated (ONNX Runtime allocates them,
        :meth:`_step_in_place` then keeps buffers like them); later steps write into those. So a step neither
        rebinds its inputs nor calls ``IOBinding.get_outputs()``, which wraps every bound output, the 2 L K/V buffers
        included: the embedded int4 model's plain step took 0.61-0.84 ms more than its graph alone before, 0.26-0.31
        ms after (``scripts/bench_row_regime.py``, 2-core EPYC, ONNX Runtime 1.32, 2026-12-07 16:40-16:41 UTC).
        """
        kept = s <= KEPT_ROWS
        buffers = self._rows.get(s)
        if buffers is None:
            buffers = _RowBuffers({name: value.copy() for name, value in feeds.items()})
            if kept:
                self._rows[s] = buffers
        else:
            for name, value in feeds.items():
                np.copyto(buffers.inputs[name], value)
        state = (s, buffers.outputs is not None) if kept else None
        if state is not None and self._bound_rows == state:
            return buffers
        for name, b in buffers.inputs.items():
            io.bind_input(name, "cpu", 0, b.dtype, list(b.shape), b.ctypes.data)
        for j, name in enumerate(self._host_outputs):
            if buffers.outputs is None:  # unallocated again: a run keeps its outputs bound, and S changes
                io.bind_output(name)
            else:
                b = buffers.outputs[j]
                io.bind_output(name, "cpu", 0, b.dtype, list(b.shape), b.ctypes.data)
        self._bound_rows = state
        return buffers

    def close(self) -> None:
        """Nothing to free: the sessions and caches are host memory (the garbage collector's)."""

    def heads(self, hidden: np.ndarray, topk: int) -> np.ndarray:
        """hidden [R, d] -> int64 [R, K, topk] (topk fixed by the artifact's heads graph)."""
        self._medusa_heads()
        return self.heads_session.run(["medusa_topk_ids"],
                                      {"hidden_states": np.ascontiguousarray(hidden, self.hidden_dtype)})[0]

    def heads_logprobs(self, hidden: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
        """hidden [R, d] -> (ids int64 [R, K, topk], log-probabilities float32 [R, K, topk]).

        Raises:
            MedusaError: the artifact's heads graph has no ``medusa_topk_logprobs`` output (built before it).
        """
        self._medusa_heads()
        if "medusa_topk_logprobs" not in self._heads_outputs:
            raise MedusaError("per-step trees need the heads' log-probabilities, and this artifact's heads graph "
                              "has no medusa_topk_logprobs output: rebuild it (or use a static --tree)")
        ids, lp = self.heads_session.run(["medusa_topk_ids", "medusa_topk_logprobs"],
                                         {"hidden_states": np.ascontiguousarray(hidden, self.hidden_dtype)})
        return ids, lp

    def heads_level(self, depth: int, hidden: np.ndarray, path_ids: np.ndarray, topk: int
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Path-conditioned head ``depth`` (1-based): hidden [1, d] (or [R, d], a row per path), path_ids int64
        [R, depth] -> (ids int64 [R, topk], log-probabilities float32 [R, topk]) (``heads_level{depth}.onnx``)."""
        sess = self.level_sessions[depth - 1]
        feed = {"hidden_states": np.ascontiguousarray(hidden, self.hidden_dtype),
                "path_ids": np.ascontiguousarray(path_ids, np.int64)}
        ids, lp = sess.run(["level_topk_ids", "level_topk_logprobs"], feed)
        return ids, lp

    def _medusa_heads(self) -> None:
        if self.heads_session is None:
            raise MedusaError("this artifact's heads are path-conditioned (hydra): they run level by level "
                              "(heads_level), not as one heads graph")
