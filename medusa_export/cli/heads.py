"""``train-heads`` and ``calibrate`` sub-commands (registered by :func:`add_heads_commands`)."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from medusa_runtime.autotree import DEFAULT_SIZES as AUTO_SIZES
from medusa_runtime.treespec import DEFAULT_WIDTH

from ..errors import MedusaError
from ..loading.registry import DEFAULT_MODEL
from .args import add_prompt_file_arg, require

DEFAULT_CACHE = ".cache/train-heads"
#: The records training.distill.load_prompts reads, for --prompt-file's help.
DISTILL_PROMPT_FORMAT = "JSONL records with 'messages', 'turns', 'prompt', 'instruction' or OASST '### Human:' text"
#: Tree sizes ``calibrate`` simulates by default: those ``--tree auto`` tries (1, plain decoding, needs none).
CALIBRATED_SIZES = tuple(n for n in AUTO_SIZES if n > 1)

#: ``--dtype`` names -> torch dtype names (torch is imported only when a command runs).
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _caps(values: list[str] | None) -> dict[str, int]:
    caps = {}
    for v in values or []:
        src, _, n = v.partition("=")
        if not n.isdigit():
            raise MedusaError(f"--cap takes SOURCE=N, got {v!r}")
        caps[src] = int(n)
    return caps


def _prompts(paths: list[str]):
    from ..training.distill import load_prompts

    return [p for path in paths for p in load_prompts(path)]


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


def _init_note(args) -> str:
    start = f"the heads in {args.init_heads}" if args.init_heads else "Medusa paper §2.1.1: zero residual block"
    if args.head_type == "hydra":
        start += ("; path weights zero, so the hydra heads start equal to them" if args.init_heads
                  else " (path weights zero)")
    return start + "; projection = the frozen shared lm_head"


def _initial_heads(args, gen):
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
    if args.init_heads:
        start = load_heads(args.init_heads, gen.lm_head, embed)
        c = start.config
        if (c.num_heads, c.num_layers) != (args.num_heads, args.num_layers):
            raise MedusaError(f"--init-heads {args.init_heads} has {c.num_heads} heads of {c.num_layers} blocks; "
                              f"give --num-heads {c.num_heads} --num-layers {c.num_layers}")
    if args.head_type == "hydra":
        if start is None:
            vocab, hidden = gen.lm_head.weight.shape
            cfg = HeadsConfig(args.num_heads, args.num_layers, hidden, vocab, False, head_type="hydra")
            return HydraHeads(cfg, gen.lm_head, embed)
        if start.config.head_type == "hydra":
            return start
        try:
            return HydraHeads.from_medusa(start, embed)
        except ValueError as exc:
            raise MedusaError(f"--init-heads {args.init_heads}: {exc}") from None
    if start is not None and start.config.head_type != "medusa":
        raise MedusaError(f"--init-heads {args.init_heads} holds {start.config.head_type} heads; add --head-type "
                          f"{start.config.head_type}")
    return start


def cmd_train_heads(args) -> int:
    """Self-distil replies (stored as token ids), recompute their features, train heads, save them (+ accuracies)."""
    import torch

    from ..model.heads import save_heads
    from ..training.batch_decode import BatchedDecoder
    from ..training.distill import TrainConfig, load_generator, select_prompts, train_data, train_heads
    from ..training.draft_vocab import draft_vocab_json, frequency_order, write_draft_vocab
    from ..training.features import cached_features
    from ..training.replies import decode_requests, generate_to_store, is_sampled, reply_id
    from ..training.reply_store import ReplyStore, reply_token_count

    torch.manual_seed(args.seed)
    # One thread per process on a CPU by default: a decode step is hundreds of small ops, and on this shared
    # 2-core machine two threads synchronising on them (and on the features' forward passes) ran 3x slower
    # than one; more cores are used by --part processes side by side.
    torch.set_num_threads(args.threads or (1 if args.device == "cpu" else torch.get_num_threads()))
    t_start = time.perf_counter()
    prompts = _prompts(require(args.prompt_file, "--prompt-file"))
    train, held = select_prompts(prompts, caps=_caps(args.cap), seed=args.seed, holdout=args.holdout)
    if args.exclude:  # e.g. the calibration prompts: never answered for training, never trained on
        banned = {p.id for p in _prompts(args.exclude)}
        train = [p for p in train if p.id not in banned]
        held = [p for p in held if p.id not in banned]
    print(f"{len(train)} training prompts, {len(held)} held out", file=sys.stderr)
    if args.samples < 1 or not args.temperature > 0:
        raise MedusaError(f"--samples must be at least 1 and --temperature above 0, got {args.samples} and "
                          f"{args.temperature}")
    dtype = getattr(torch, DTYPES[args.dtype])
    gen = load_generator(args.model, model_path=args.model_path, device=check_device(args.device))
    cache = Path(args.cache)
    i_part, n_part = _part(args.part)
    store = ReplyStore(cache / "replies", vocab_size=gen.lm_head.weight.shape[0],
                       meta={"model": args.model, "max_new_tokens": args.max_new_tokens},
                       part=f"p{i_part}of{n_part}" if n_part > 1 else "")
    decoder = BatchedDecoder(gen.hf_model, batch_size=args.batch_size, dtype=dtype,
                             capacity=args.max_prompt_tokens + args.max_new_tokens + 1)
    have = store.ids()
    common = dict(have=have, seed=args.seed, max_prompt_tokens=args.max_prompt_tokens, part=(i_part, n_part),
                  sort_window=args.sort_window * args.batch_size)
    # The held-out prompts are answered first (greedy only) and never trained on.
    reqs = decode_requests(gen.tokenizer, gen.chat_template, held, **common)
    reqs += decode_requests(gen.tokenizer, gen.chat_template, train, samples=args.samples,
                            temperature=args.temperature, **common)
    budget = args.budget_tokens
    if budget is not None and n_part > 1:  # this part's share of what the store still lacks
        stored = reply_token_count(store.read())
        budget = stored + max(0, budget - stored + n_part - 1) // n_part
    stats = generate_to_store(decoder, reqs, store, max_new_tokens=args.max_new_tokens,
                              eos_token_ids=gen.eos_token_ids, budget_tokens=budget)
    if stats["replies"]:
        print(f"generated {stats['replies']} replies, {stats['tokens']} tokens in {stats['seconds']:.0f} s "
              f"({stats['tokens_per_second']:.0f} reply tokens/s)", file=sys.stderr)
    if args.generate_only:
        return 0
    by_id = {r.id: r for r in store.read()}
    held_replies = [by_id[p.id] for p in held if p.id in by_id]
    replies = [by_id[rid] for j in range(args.samples) for p in train if (rid := reply_id(p.id, j)) in by_id]
    if args.max_tokens is not None:  # a prefix, greedy replies first (data-scaling runs)
        kept, total = [], 0
        for r in replies:
            if total >= args.max_tokens:
                break
            kept.append(r)
            total += len(r.reply)
        replies = kept
    if not replies:
        raise MedusaError(f"no stored replies to train on in {cache / 'replies'}")
    cfg = TrainConfig(num_heads=args.num_heads, num_layers=args.num_layers, epochs=args.epochs,
                      batch_tokens=args.batch_tokens, lr=args.lr, soft_topk=args.soft_topk,
                      loss_decay=args.loss_decay, train_vocab=args.train_vocab, seed=args.seed)
    tokens = [r.reply.tolist() for r in replies]
    t_feat = time.perf_counter()
    # Features always hold the teacher's top-S for S >= the default (one lm_head product per position, ~1/4 of
    # the forward pass): soft and hard-label trainings, and smaller S, share one set of cached features.
    feats = cached_features(decoder, replies, cache / "features", soft_topk=max(cfg.soft_topk, TrainConfig.soft_topk),
                            source=args.model,
                            batch_tokens=args.features_batch_tokens, progress=True, part=(i_part, n_part))
    feat_seconds = time.perf_counter() - t_feat
    if feats is None or args.features_only:  # a part, or only the features: the training run reads them
        print(f"features of part {i_part}/{n_part} cached in {feat_seconds:.0f} s", file=sys.stderr)
        return 0
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
                                               gen.lm_head.weight.shape[0], 1, model=args.model))
    print(f"{len(replies)} replies, {data.num_tokens} training positions", file=sys.stderr)
    ckpt = cache / "checkpoints" / (f"{args.head_type}h{cfg.num_heads}l{cfg.num_layers}s{cfg.soft_topk}e{cfg.epochs}"
                                    f"lr{cfg.lr}b{cfg.batch_tokens}d{cfg.loss_decay}v{cfg.train_vocab}"
                                    f"n{data.num_tokens}{'-init' if args.init_heads else ''}.pt")
    init = _initial_heads(args, gen)
    res = train_heads(data, gen.lm_head, cfg, checkpoint=ckpt, vocab_ids=vocab_ids, heads=init)
    gen.hf_model.cpu()  # the heads share its lm_head: saving and held-out accuracies run on the CPU
    heads = res.heads
    recipe = {
        "recipe": {**cfg.__dict__, "train_prompts": len({_prompt_of(r.id) for r in replies}),
                   "train_tokens": data.num_tokens, "data": args.prompt_file, "caps": _caps(args.cap),
                   "holdout": args.holdout, "max_new_tokens": args.max_new_tokens, "samples": args.samples,
                   "temperature": args.temperature if args.samples > 1 else None, "device": args.device,
                   "dtype": args.dtype,
                   "replies": {"greedy": sum(not is_sampled(r.id) for r in replies),
                               "sampled": sum(is_sampled(r.id) for r in replies),
                               "tokens": reply_token_count(replies)},
                   "loss": f"sum_k {cfg.loss_decay}^k CE(head k, token t+k+1)"
                           + (f" over the draft vocabulary's top {cfg.train_vocab} ids" if cfg.train_vocab else ""),
                   "targets": f"teacher top-{cfg.soft_topk}" if cfg.soft_topk else "hard (the reply's tokens)",
                   "head_type": args.head_type,
                   "init": _init_note(args),
                   "features_seconds": round(feat_seconds, 1),
                   "train_seconds": round(res.seconds, 1),
                   "total_seconds": round(time.perf_counter() - t_start, 1),
                   "final": res.history[-1] if res.history else None},
        "backbone": gen.source,
        "command": "medusa-export " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    }
    save_heads(heads, args.out, extra=recipe)
    write_draft_vocab(draft, args.out)
    if held_replies:
        from ..training.calibrate import head_accuracies, save_accuracies

        held_feats = cached_features(decoder, held_replies, cache / "features", source=args.model)
        hid, start = [], 0
        for n in held_feats.lengths:
            hid.append(held_feats.hidden[start:start + n].float())
            start += n
        acc = head_accuracies(heads, hid, [r.reply.tolist() for r in held_replies])
        save_accuracies(acc, args.out, source=f"held-out split of the training prompts ({len(held_replies)} prompts)",
                        positions=sum(len(r.reply) for r in held_replies), head_type=heads.config.head_type)
        print("held-out top-1 per head: " + ", ".join(f"{a:.3f}" for a in acc[:, 0]), file=sys.stderr)
    print(f"heads written to {args.out} (features {feat_seconds / 60:.1f} min, train {res.seconds / 60:.1f} min, "
          f"total {(time.perf_counter() - t_start) / 60:.1f} min)", file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    """Measure a_k^(i) and the probability map on held-out prompts, simulate static and per-step trees,
    save accuracies.json beside the heads."""
    import numpy as np
    from medusa_runtime.treespec import DynamicTree
    from medusa_runtime.tree import expected_accept_length, greedy_tree

    from ..loading.registry import entry_for, load_entry_heads
    from ..training.calibrate import calibrate, save_accuracies, simulate_dynamic, simulate_steps
    from ..training.distill import load_generator

    import torch

    if args.eval and args.out is None:
        raise MedusaError("--eval writes its measurements to --out (never over the heads' calibration)")
    torch.set_num_threads(args.threads or 1)  # see train-heads --threads
    gen = load_generator(args.model, model_path=args.model_path)
    entry, _ = entry_for(args.model)
    heads, source, heads_path = load_entry_heads(entry, gen.loaded, args.heads, lm_head=gen.lm_head,
                                                 embed_tokens=gen.hf_model.model.embed_tokens)
    if heads is None:
        raise MedusaError(f"{args.model} has no trained heads to calibrate (its heads would be the untrained "
                          "initial ones); give --heads DIR")
    if args.out is None and entry.heads["source"] in ("hf", "backbone") and not args.heads:
        raise MedusaError(f"the heads of {args.model} come from {source}; give --out DIR for accuracies.json "
                          "(the Hugging Face cache is not written to)")
    heads_dir = heads_path if heads_path.is_dir() else heads_path.parent
    prompts = _prompts(require(args.prompt_file, "--prompt-file"))[: args.limit or None]
    vocab_ids = None
    if args.heads_vocab:
        from ..loading.draft_vocab import load_draft_vocab, subset_ids

        vocab_ids = subset_ids(load_draft_vocab(heads_dir), args.heads_vocab, gen.lm_head.weight.shape[0], args.topk,
                               model=args.model)
    res = calibrate(gen, heads, prompts, Path(args.cache) / "calibrate", max_new_tokens=args.max_new_tokens,
                    batch_size=args.batch_size, topk=args.topk, vocab_ids=vocab_ids)
    sim_tokens = args.max_new_tokens - 5  # replies run 5 tokens past the simulated length: the last step is scored
    head_type = heads.config.head_type
    tree_acc, prob_map = res.accuracies, res.probability_map
    if args.eval:  # measure only: trees and per-step scores from the heads' own calibration, not from these prompts
        from medusa_runtime.candidates import ProbabilityMap

        from ..loading.accuracies import load_accuracies_doc

        doc = load_accuracies_doc(heads_dir)
        if doc is None or "calibration" not in doc:
            raise MedusaError(f"--eval needs the heads' calibration (accuracies.json with a probability map beside "
                              f"{heads_dir}): run calibrate on held-out prompts first")
        tree_acc, prob_map = np.asarray(doc["accuracies"], dtype=np.float64), ProbabilityMap.from_json(doc["calibration"])
    print(f"{head_type} heads, top-1 accuracy per head: " + ", ".join(f"{a:.3f}" for a in res.accuracies[:, 0]))
    print(f"{'nodes':>6} {'depth':>5} {'expected':>9} {'static':>9} {'per-step':>9}")
    simulated: dict[str, dict[int, float]] = {"static": {}, "dynamic": {}}
    for budget in args.budgets:
        tree = greedy_tree(budget, tree_acc)
        static = [s for t, k in zip(res.tokens, res.topk_ids)
                  for s in simulate_steps(t, k, tree, max_new_tokens=sim_tokens, eos_token_ids=gen.eos_token_ids)]
        spec = DynamicTree(budget, heads.config.num_heads, args.topk, args.width, prob_map)
        dyn = [s for t, h, ids, lp in zip(res.tokens, res.hiddens, res.topk_ids, res.topk_logprobs)
               for s in simulate_dynamic(heads, h, t, spec, max_new_tokens=sim_tokens,
                                         eos_token_ids=gen.eos_token_ids, topk=(ids, lp), vocab_ids=vocab_ids)]
        simulated["static"][budget], simulated["dynamic"][budget] = float(np.mean(static)), float(np.mean(dyn))
        print(f"{tree.size:>6} {tree.max_depth:>5} {expected_accept_length(tree, tree_acc):>9.3f} "
              f"{simulated['static'][budget]:>9.3f} {simulated['dynamic'][budget]:>9.3f}", flush=True)
    out = args.out or heads_dir
    path = save_accuracies(res.accuracies, out, source=", ".join(args.prompt_file), positions=res.positions,
                           head_type=head_type, calibration=res.probability_map, simulated=simulated)
    print(f"accuracies, probability map and simulated tokens/step written to {path}")
    return 0


def add_heads_commands(sub) -> None:
    """Register ``train-heads`` and ``calibrate``."""
    from ..model.heads import HEAD_TYPES
    from ..training.distill import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train-heads", help="train Medusa heads on a frozen backbone (self-distillation)",
                       description="The backbone answers the prompts with its chat template (own batched decode "
                                   "loop); the replies are stored as token ids, their hidden states (and the teacher's "
                                   "top-S) recomputed in batched passes, and the heads learn on them with loss "
                                   "sum_k 0.8^k CE (Medusa-1). Resumable: replies, features and training checkpoints "
                                   "are cached under --cache.")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"registered model or path (default: {DEFAULT_MODEL})")
    p.add_argument("--model-path", help="local backbone weights instead of the registry's source")
    add_prompt_file_arg(p, "training prompts (required)", aliases=("--data",), repeatable=True,
                        formats=DISTILL_PROMPT_FORMAT)
    p.add_argument("--cap", action="append", help="SOURCE=N: at most N prompts of a source (repeatable)")
    p.add_argument("--holdout", type=int, default=32,
                   help="prompts answered but never trained on; the heads' accuracies on them go to accuracies.json "
                        "(default: 32)")
    p.add_argument("--out", required=True, help="output heads directory")
    p.add_argument("--cache", default=DEFAULT_CACHE, help=f"cache directory (default: {DEFAULT_CACHE})")
    p.add_argument("--batch-size", type=int, default=64, help="rows decoded together (default: 64)")
    p.add_argument("--max-new-tokens", type=int, default=320, help="reply length cap (default: 320)")
    p.add_argument("--max-prompt-tokens", type=int, default=768, help="longer prompts are skipped (default: 768)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16",
                   help="generation and feature recomputation dtype (default: bf16; fp32 is ~4x slower on a CPU)")
    p.add_argument("--threads", type=int,
                   help="PyTorch threads (default on a CPU: 1; several one-thread processes (--part) use more "
                        "cores better than threads on a shared machine; on an idle one, training gains from 2)")
    p.add_argument("--features-batch-tokens", type=int, default=8192,
                   help="padded tokens per teacher-forced pass when recomputing hidden states (default: 8192)")
    p.add_argument("--sort-window", type=int, default=4,
                   help="sort prompts by length within windows of this many batches (default: 4)")
    p.add_argument("--budget-tokens", type=int, help="stop generating once the cache holds this many reply tokens")
    p.add_argument("--max-tokens", type=int,
                   help="train on only the first N stored reply tokens (greedy replies first, in prompt order)")
    p.add_argument("--generate-only", action="store_true", help="fill the reply store and stop")
    p.add_argument("--features-only", action="store_true",
                   help="also compute and cache the features (hidden states, teacher top-S), then stop; with --part, "
                        "each process computes its share of the feature chunks")
    p.add_argument("--exclude", action="append", default=[], metavar="JSONL",
                   help="prompts never answered or trained on, matched by id (repeatable; e.g. the "
                        "calibration prompts given to 'calibrate')")
    p.add_argument("--part", default="0/1", metavar="I/N",
                   help="answer only every N-th prompt from the I-th (and, with --features-only, compute every N-th "
                        "feature chunk): run N processes (one thread each) side by side on the same cache, then "
                        "train without --part (default: 0/1)")
    p.add_argument("--samples", type=int, default=1,
                   help="replies per training prompt: the greedy one plus N-1 sampled at --temperature, more "
                        "self-distillation text from few prompts (default: 1)")
    p.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled replies (default: 0.7)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda or cuda:N: where generation, teacher targets and training run (default: cpu)")
    p.add_argument("--head-type", choices=HEAD_TYPES, default=HEAD_TYPES[0],
                   help="medusa: head k reads h_t alone (Medusa paper); hydra: head k also reads the root and the "
                        "path's tokens (path-conditioned, Hydra), candidates level by level (default: medusa)")
    p.add_argument("--init-heads", metavar="DIR",
                   help="start from these heads (Medusa heads start hydra heads equal to them); default: fresh heads")
    p.add_argument("--num-heads", type=int, default=d.num_heads, help=f"K (default: {d.num_heads})")
    p.add_argument("--num-layers", type=int, default=d.num_layers, help=f"residual blocks per head (default: {d.num_layers})")
    p.add_argument("--epochs", type=float, default=d.epochs, help=f"(default: {d.epochs})")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help=f"positions per step (default: {d.batch_tokens})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default: {d.lr})")
    p.add_argument("--soft-topk", type=int, default=d.soft_topk,
                   help=f"soft targets: the backbone's top-S distribution; 0 = hard labels (default: {d.soft_topk})")
    p.add_argument("--loss-decay", type=float, default=d.loss_decay,
                   help=f"head k's loss weight is DECAY^k (1 = equal weights) (default: {d.loss_decay})")
    p.add_argument("--train-vocab", type=int, default=d.train_vocab,
                   help="train the projection on the N most frequent reply tokens only (FR-Spec; ~6x faster at "
                        f"8192 for V=49152; export with build --heads-vocab); 0 = full vocabulary (default: {d.train_vocab})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"(default: {d.seed})")
    p.set_defaults(func=cmd_train_heads)

    p = sub.add_parser("calibrate", help="measure the heads' top-i accuracies (tree building, Medusa paper §2.3.3)",
                       description="Greedy replies to held-out prompts; each head's top-i accuracy a_k^(i) on them "
                                   "is written to accuracies.json beside the heads, where --tree N finds it.")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"registered model or path (default: {DEFAULT_MODEL})")
    p.add_argument("--model-path", help="local backbone weights instead of the registry's source")
    p.add_argument("--heads", help="heads directory or file (default: the model's registered heads, or those "
                                   "stored in its checkpoint)")
    add_prompt_file_arg(p, "held-out prompts (required)", aliases=("--data",), repeatable=True,
                        formats=DISTILL_PROMPT_FORMAT)
    p.add_argument("--limit", type=int, help="use only the first N prompts")
    p.add_argument("--out", help="where accuracies.json goes (default: the heads directory; required for heads "
                                 "read from the Hugging Face cache)")
    p.add_argument("--cache", default=DEFAULT_CACHE, help=f"cache directory (default: {DEFAULT_CACHE})")
    p.add_argument("--max-new-tokens", type=int, default=133, help="reply length (default: 133)")
    p.add_argument("--batch-size", type=int, default=32, help="generation batch (default: 32)")
    p.add_argument("--topk", type=int, default=10, help="top-i measured per head (default: 10)")
    p.add_argument("--budgets", type=int, nargs="+", default=list(CALIBRATED_SIZES),
                   help="tree sizes to simulate, static and per step; --tree auto reads the table "
                        f"(default: {' '.join(map(str, CALIBRATED_SIZES))})")
    p.add_argument("--threads", type=int, help="PyTorch threads (default: 1, see train-heads --threads)")
    p.add_argument("--heads-vocab", type=int, default=0,
                   help="measure the heads projected onto the top N ids of draft_vocab.json beside them, as an "
                        "artifact built with --heads-vocab N runs them (default: 0, all V)")
    p.add_argument("--eval", action="store_true",
                   help="measure only (e.g. on MT-Bench): build the trees and score per-step trees with the heads' "
                        "own calibration (accuracies.json beside them), write the measurements to --out")
    p.add_argument("--width", type=int, default=DEFAULT_WIDTH,
                   help=f"per-step trees of path-conditioned heads: nodes expanded per level (default: {DEFAULT_WIDTH})")
    p.set_defaults(func=cmd_calibrate)
