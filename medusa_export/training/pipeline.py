"""Head training as one pipeline (``medusa-export train-heads``): prompts -> self-distilled replies (stored as token
ids) -> the backbone's features -> trained heads, with their recipe, draft vocabulary and held-out accuracies.

The stages it drives sit beside it: :mod:`.distill` (prompts, the generator, the training loop), :mod:`.replies`
and :mod:`.reply_store` (decoding requests and the reply cache), :mod:`.batch_decode` (batched decoding),
:mod:`.features` (cached hidden states), :mod:`.draft_vocab` and :mod:`.calibrate`. The CLI only parses its
flags into :class:`TrainHeadsOptions` and reports.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import MedusaError
from ..loading.registry import DEFAULT_MODEL
from ..model.heads import HEAD_TYPES
from .distill import TrainConfig

#: ``dtype`` names -> torch dtype names (torch is imported only when a run starts).
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
#: Where replies, features and checkpoints are cached between runs.
DEFAULT_CACHE = ".cache/train-heads"
_T = TrainConfig


@dataclass(frozen=True)
class TrainHeadsOptions:
    """One ``train-heads`` run (each field is the CLI flag of the same name; ``--help`` explains them).

    Data: ``prompt_file`` (JSONL files), ``cap`` ("SOURCE=N" strings), ``holdout`` (prompts held out for the
    accuracies), ``exclude`` (JSONL files never answered nor trained on). Replies: ``model``, ``model_path``,
    ``max_new_tokens``, ``max_prompt_tokens``, ``samples`` (replies per prompt; > 1 samples at ``temperature``),
    ``batch_size``, ``dtype`` (:data:`DTYPES`), ``device``, ``threads``, ``sort_window``, ``budget_tokens``,
    ``part`` ("I/N"), ``generate_only``. Features: ``features_batch_tokens``, ``features_only``. Training:
    ``head_type``, ``init_heads``, ``max_tokens`` and :class:`~.distill.TrainConfig`'s fields. Output: ``out``,
    ``cache``, and ``command`` (the command line, recorded in the recipe).
    """

    prompt_file: tuple[str, ...]
    out: str
    model: str = DEFAULT_MODEL
    model_path: str | None = None
    cap: tuple[str, ...] = ()
    holdout: int = 32
    exclude: tuple[str, ...] = ()
    cache: str = DEFAULT_CACHE
    batch_size: int = 64
    max_new_tokens: int = 320
    max_prompt_tokens: int = 768
    dtype: str = "bf16"
    threads: int | None = None
    features_batch_tokens: int = 8192
    sort_window: int = 4
    budget_tokens: int | None = None
    max_tokens: int | None = None
    generate_only: bool = False
    features_only: bool = False
    part: str = "0/1"
    samples: int = 1
    temperature: float = 0.7
    device: str = "cpu"
    head_type: str = HEAD_TYPES[0]
    init_heads: str | None = None
    num_heads: int = _T.num_heads
    num_layers: int = _T.num_layers
    epochs: float = _T.epochs
    batch_tokens: int = _T.batch_tokens
    lr: float = _T.lr
    soft_topk: int = _T.soft_topk
    loss_decay: float = _T.loss_decay
    train_vocab: int = _T.train_vocab
    seed: int = _T.seed
    command: str = field(default="", compare=False)


def load_prompt_files(paths) -> list:
    """The prompts of every JSONL file in ``paths`` (:func:`~.distill.load_prompts`), in order."""
    from .distill import load_prompts

    return [p for path in paths for p in load_prompts(path)]



def _caps(values: list[str] | None) -> dict[str, int]:
    caps = {}
    for v in values or []:
        src, _, n = v.partition("=")
        if not n.isdigit():
            raise MedusaError(f"--cap takes SOURCE=N, got {v!r}")
        caps[src] = int(n)
    return caps


def _part(text: str) -> tuple[int, int]:
    i, sep, n = str(text).partition("/")
    if not (sep and i.strip().isdigit() and n.strip().isdigit() and 0 <= int(i) < int(n)):
        raise MedusaError(f"--part must be I/N with 0 <= I < N (e.g. 0/2), got {text!r}")
    return int(i), int(n)


def check_device(name: str) -> str:
    """Check a ``--device`` value: ``cpu``, or ``cuda``/``cuda:N`` where PyTorch sees that GPU.

    Returns:
        ``name`` unchanged.

    Raises:
        MedusaError: another name, or a CUDA device PyTorch does not see here (the message
            lists the usable ones).
    """
    import torch

    if name == "cpu":
        return name
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(name[5:]) if ":" in name else 0
        if index >= n:
            raise MedusaError(f"--device {name}: PyTorch sees {n} CUDA device(s) here; use --device cpu"
                              + (f" or cuda:0..cuda:{n - 1}" if n else ""))
        return name
    raise MedusaError(f"--device must be cpu, cuda or cuda:N, got {name!r}")


def _prompt_of(rid: str) -> str:
    return rid.split("~s", 1)[0]


def _init_note(opts: "TrainHeadsOptions") -> str:
    start = f"the heads in {opts.init_heads}" if opts.init_heads else "Medusa paper §2.1.1: zero residual block"
    if opts.head_type == "hydra":
        start += ("; path weights zero, so the hydra heads start equal to them" if opts.init_heads
                  else " (path weights zero)")
    return start + "; projection = the frozen shared lm_head"


def _initial_heads(opts: "TrainHeadsOptions", gen):
    """The heads training starts from: None (fresh Medusa heads), fresh or Medusa-initialised hydra heads, or
    ``--init-heads`` of the same type.

    Raises:
        MedusaError: ``--init-heads`` of another shape than --num-heads / --num-layers, or hydra heads
            asked to start from heads with their own projections.
    """
    from ..loading.heads_formats import load_heads
    from ..model.heads import HeadsConfig
    from ..model.hydra_heads import HydraHeads

    embed = gen.hf_model.model.embed_tokens
    start = None
    if opts.init_heads:
        start = load_heads(opts.init_heads, gen.lm_head, embed)
        c = start.config
        if (c.num_heads, c.num_layers) != (opts.num_heads, opts.num_layers):
            raise MedusaError(f"--init-heads {opts.init_heads} has {c.num_heads} heads of {c.num_layers} blocks; "
                              f"give --num-heads {c.num_heads} --num-layers {c.num_layers}")
    if opts.head_type == "hydra":
        if start is None:
            vocab, hidden = gen.lm_head.weight.shape
            cfg = HeadsConfig(opts.num_heads, opts.num_layers, hidden, vocab, False, head_type="hydra")
            return HydraHeads(cfg, gen.lm_head, embed)
        if start.config.head_type == "hydra":
            return start
        try:
            return HydraHeads.from_medusa(start, embed)
        except ValueError as exc:
            raise MedusaError(f"--init-heads {opts.init_heads}: {exc}") from None
    if start is not None and start.config.head_type != "medusa":
        raise MedusaError(f"--init-heads {opts.init_heads} holds {start.config.head_type} heads; add --head-type "
                          f"{start.config.head_type}")
    return start


def train_heads_run(opts: TrainHeadsOptions) -> Path:
    """``medusa-export train-heads``: self-distil replies (stored as token ids), recompute their features, train
    heads (Medusa paper §2.2.1 Medusa-1, §2.3.2 self-distillation), save them with their recipe, draft vocabulary
    and held-out accuracies.

    Args:
        opts: the run's options (:class:`TrainHeadsOptions`).

    Returns:
        ``opts.out`` (the heads folder), or None when the run stopped early by request (``generate_only``,
        ``features_only``, or one ``part`` of several whose features are now cached).

    Raises:
        MedusaError: bad ``samples`` / ``temperature`` / ``part`` / ``cap`` / ``device``, no stored replies to train
            on, ``init_heads`` of another shape or type.
    """
    import torch

    from ..model.heads import save_heads
    from .batch_decode import BatchedDecoder
    from .distill import TrainConfig, load_generator, select_prompts, train_data, train_heads
    from .draft_vocab import draft_vocab_json, frequency_order, write_draft_vocab
    from .features import cached_features
    from .replies import decode_requests, generate_to_store, is_sampled, reply_id
    from .reply_store import ReplyStore, reply_token_count

    torch.manual_seed(opts.seed)
    # One thread per process on a CPU by default: a decode step is hundreds of small ops, and on this shared
    # 2-core machine two threads synchronising on them (and on the features' forward passes) ran 3x slower
    # than one; more cores are used by --part processes side by side.
    torch.set_num_threads(opts.threads or (1 if opts.device == "cpu" else torch.get_num_threads()))
    t_start = time.perf_counter()
    prompts = load_prompt_files(opts.prompt_file)
    train, held = select_prompts(prompts, caps=_caps(opts.cap), seed=opts.seed, holdout=opts.holdout)
    if opts.exclude:  # e.g. the calibration prompts: never answered for training, never trained on
        banned = {p.id for p in load_prompt_files(opts.exclude)}
        train = [p for p in train if p.id not in banned]
        held = [p for p in held if p.id not in banned]
    print(f"{len(train)} training prompts, {len(held)} held out", file=sys.stderr)
    if opts.samples < 1 or not opts.temperature > 0:
        raise MedusaError(f"--samples must be at least 1 and --temperature above 0, got {opts.samples} and "
                          f"{opts.temperature}")
    dtype = getattr(torch, DTYPES[opts.dtype])
    gen = load_generator(opts.model, model_path=opts.model_path, device=check_device(opts.device))
    cache = Path(opts.cache)
    i_part, n_part = _part(opts.part)
    store = ReplyStore(cache / "replies", vocab_size=gen.lm_head.weight.shape[0],
                       meta={"model": opts.model, "max_new_tokens": opts.max_new_tokens},
                       part=f"p{i_part}of{n_part}" if n_part > 1 else "")
    decoder = BatchedDecoder(gen.hf_model, batch_size=opts.batch_size, dtype=dtype,
                             capacity=opts.max_prompt_tokens + opts.max_new_tokens + 1)
    have = store.ids()
    common = dict(have=have, seed=opts.seed, max_prompt_tokens=opts.max_prompt_tokens, part=(i_part, n_part),
                  sort_window=opts.sort_window * opts.batch_size)
    # The held-out prompts are answered first (greedy only) and never trained on.
    reqs = decode_requests(gen.tokenizer, gen.chat_template, held, **common)
    reqs += decode_requests(gen.tokenizer, gen.chat_template, train, samples=opts.samples,
                            temperature=opts.temperature, **common)
    budget = opts.budget_tokens
    if budget is not None and n_part > 1:  # this part's share of what the store still lacks
        stored = reply_token_count(store.read())
        budget = stored + max(0, budget - stored + n_part - 1) // n_part
    stats = generate_to_store(decoder, reqs, store, max_new_tokens=opts.max_new_tokens,
                              eos_token_ids=gen.eos_token_ids, budget_tokens=budget)
    if stats["replies"]:
        print(f"generated {stats['replies']} replies, {stats['tokens']} tokens in {stats['seconds']:.0f} s "
              f"({stats['tokens_per_second']:.0f} reply tokens/s)", file=sys.stderr)
    if opts.generate_only:
        return None
    by_id = {r.id: r for r in store.read()}
    held_replies = [by_id[p.id] for p in held if p.id in by_id]
    replies = [by_id[rid] for j in range(opts.samples) for p in train if (rid := reply_id(p.id, j)) in by_id]
    if opts.max_tokens is not None:  # a prefix, greedy replies first (data-scaling runs)
        kept, total = [], 0
        for r in replies:
            if total >= opts.max_tokens:
                break
            kept.append(r)
            total += len(r.reply)
        replies = kept
    if not replies:
        raise MedusaError(f"no stored replies to train on in {cache / 'replies'}")
    cfg = TrainConfig(num_heads=opts.num_heads, num_layers=opts.num_layers, epochs=opts.epochs,
                      batch_tokens=opts.batch_tokens, lr=opts.lr, soft_topk=opts.soft_topk,
                      loss_decay=opts.loss_decay, train_vocab=opts.train_vocab, seed=opts.seed)
    tokens = [r.reply.tolist() for r in replies]
    t_feat = time.perf_counter()
    # Features always hold the teacher's top-S for S >= the default (one lm_head product per position, ~1/4 of
    # the forward pass): soft and hard-label trainings, and smaller S, share one set of cached features.
    feats = cached_features(decoder, replies, cache / "features", soft_topk=max(cfg.soft_topk, TrainConfig.soft_topk),
                            source=opts.model,
                            batch_tokens=opts.features_batch_tokens, progress=True, part=(i_part, n_part))
    feat_seconds = time.perf_counter() - t_feat
    if feats is None or opts.features_only:  # a part, or only the features: the training run reads them
        print(f"features of part {i_part}/{n_part} cached in {feat_seconds:.0f} s", file=sys.stderr)
        return None
    teacher = None
    if cfg.soft_topk:  # the first S of the cached top-S', renormalised
        p = feats.teacher_p[:, :cfg.soft_topk]
        teacher = (feats.teacher_ids[:, :cfg.soft_topk], p / p.sum(-1, keepdim=True))
    data = train_data(feats.hidden, tokens, cfg.num_heads, teacher=teacher)
    del feats
    ids, counts = frequency_order(tokens)
    draft = draft_vocab_json(ids, counts, vocab_size=gen.lm_head.weight.shape[0],
                             source=f"train-heads replies ({len(replies)} replies, {reply_token_count(replies)} tokens)")
    vocab_ids = None
    if cfg.train_vocab:
        from ..loading.draft_vocab import DraftVocab, subset_ids

        vocab_ids = torch.as_tensor(subset_ids(DraftVocab(ids, draft["source"]), cfg.train_vocab,
                                               gen.lm_head.weight.shape[0], 1, model=opts.model))
    print(f"{len(replies)} replies, {data.num_tokens} training positions", file=sys.stderr)
    ckpt = cache / "checkpoints" / (f"{opts.head_type}h{cfg.num_heads}l{cfg.num_layers}s{cfg.soft_topk}e{cfg.epochs}"
                                    f"lr{cfg.lr}b{cfg.batch_tokens}d{cfg.loss_decay}v{cfg.train_vocab}"
                                    f"n{data.num_tokens}{'-init' if opts.init_heads else ''}.pt")
    init = _initial_heads(opts, gen)
    res = train_heads(data, gen.lm_head, cfg, checkpoint=ckpt, vocab_ids=vocab_ids, heads=init)
    gen.hf_model.cpu()  # the heads share its lm_head: saving and held-out accuracies run on the CPU
    heads = res.heads
    recipe = {
        "recipe": {**cfg.__dict__, "train_prompts": len({_prompt_of(r.id) for r in replies}),
                   "train_tokens": data.num_tokens, "data": opts.prompt_file, "caps": _caps(opts.cap),
                   "holdout": opts.holdout, "max_new_tokens": opts.max_new_tokens, "samples": opts.samples,
                   "temperature": opts.temperature if opts.samples > 1 else None, "device": opts.device,
                   "dtype": opts.dtype,
                   "replies": {"greedy": sum(not is_sampled(r.id) for r in replies),
                               "sampled": sum(is_sampled(r.id) for r in replies),
                               "tokens": reply_token_count(replies)},
                   "loss": f"sum_k {cfg.loss_decay}^k CE(head k, token t+k+1)"
                           + (f" over the draft vocabulary's top {cfg.train_vocab} ids" if cfg.train_vocab else ""),
                   "targets": f"teacher top-{cfg.soft_topk}" if cfg.soft_topk else "hard (the reply's tokens)",
                   "head_type": opts.head_type,
                   "init": _init_note(opts),
                   "features_seconds": round(feat_seconds, 1),
                   "train_seconds": round(res.seconds, 1),
                   "total_seconds": round(time.perf_counter() - t_start, 1),
                   "final": res.history[-1] if res.history else None},
        "backbone": gen.source,
        "command": opts.command,
    }
    save_heads(heads, opts.out, extra=recipe)
    write_draft_vocab(draft, opts.out)
    if held_replies:
        from .calibrate import head_accuracies, save_accuracies

        held_feats = cached_features(decoder, held_replies, cache / "features", source=opts.model)
        hid, start = [], 0
        for n in held_feats.lengths:
            hid.append(held_feats.hidden[start:start + n].float())
            start += n
        acc = head_accuracies(heads, hid, [r.reply.tolist() for r in held_replies])
        save_accuracies(acc, opts.out, source=f"held-out split of the training prompts ({len(held_replies)} prompts)",
                        positions=sum(len(r.reply) for r in held_replies), head_type=heads.config.head_type)
        print("held-out top-1 per head: " + ", ".join(f"{a:.3f}" for a in acc[:, 0]), file=sys.stderr)
    print(f"heads written to {opts.out} (features {feat_seconds / 60:.1f} min, train {res.seconds / 60:.1f} min, "
          f"total {(time.perf_counter() - t_start) / 60:.1f} min)", file=sys.stderr)
    return Path(opts.out)
