"""``train-heads`` and ``calibrate`` sub-commands (registered by :func:`add_heads_commands`)."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

from ..errors import MedusaError
from ..loading.registry import DEFAULT_MODEL
from .args import add_prompt_file_arg, require

DEFAULT_CACHE = ".cache/train-heads"
#: The records training.distill.load_prompts reads, for --prompt-file's help.
DISTILL_PROMPT_FORMAT = "JSONL records with 'messages', 'turns', 'prompt', 'instruction' or OASST '### Human:' text"


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

    out = []
    for p in paths:
        if not Path(p).is_file():
            raise MedusaError(f"prompt file {p} does not exist")
        out.extend(load_prompts(p))
    return out


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


def cmd_train_heads(args) -> int:
    """Self-distil replies, cache hidden states, train Medusa-1 heads, save them (+ held-out accuracies)."""
    import torch

    from ..model.heads import save_heads
    from ..training.distill import (TrainConfig, build_train_data, generate_replies, is_sampled, load_generator,
                                    load_hidden, select_prompts, teacher_topk, train_heads)

    torch.manual_seed(args.seed)
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
    gen = load_generator(args.model, model_path=args.model_path, device=check_device(args.device))
    cache = Path(args.cache)
    common = dict(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, eos_token_ids=gen.eos_token_ids,
                  pad_token_id=gen.pad_token_id, budget_tokens=args.budget_tokens, sort_window=args.sort_window,
                  part=_part(args.part), seed=args.seed)
    # One cache; the held-out prompts are answered first (greedy only) and never trained on.
    replies = generate_replies(gen.hf_model, gen.tokenizer, gen.chat_template, held, cache / "train", **common)
    replies = generate_replies(gen.hf_model, gen.tokenizer, gen.chat_template, train, cache / "train",
                               samples=args.samples, temperature=args.temperature, **common)
    held_ids = {p.id for p in held}
    held_replies = [r for r in replies if r.id in held_ids]
    replies = [r for r in replies if r.id not in held_ids]
    if args.generate_only:
        return 0
    if args.max_tokens is not None:  # a prefix of the cache (data-scaling runs)
        kept, total = [], 0
        for r in replies:
            if total >= args.max_tokens:
                break
            kept.append(r)
            total += len(r.tokens)
        replies = kept
    cfg = TrainConfig(num_heads=args.num_heads, num_layers=args.num_layers, epochs=args.epochs,
                      batch_tokens=args.batch_tokens, lr=args.lr, soft_topk=args.soft_topk, seed=args.seed)
    hiddens = load_hidden(cache / "train", replies)
    tokens = [r.tokens for r in replies]
    teacher = None
    if cfg.soft_topk:
        n = sum(len(t) for t in tokens)
        tfile = cache / "train" / f"teacher-top{cfg.soft_topk}-{n}.pt"
        if tfile.is_file():
            teacher = torch.load(str(tfile), weights_only=True)
        else:
            teacher = teacher_topk(torch.cat(hiddens), gen.lm_head.weight, cfg.soft_topk, progress=True)
            torch.save(teacher, str(tfile))
    data = build_train_data(tokens, hiddens, cfg.num_heads, lm_weight=gen.lm_head.weight,
                            soft_topk=cfg.soft_topk, teacher=teacher)
    del hiddens
    print(f"{len(replies)} replies, {data.num_tokens} training positions", file=sys.stderr)
    ckpt = cache / "checkpoints" / (f"h{cfg.num_heads}l{cfg.num_layers}s{cfg.soft_topk}e{cfg.epochs}"
                                    f"lr{cfg.lr}b{cfg.batch_tokens}n{data.num_tokens}.pt")
    res = train_heads(data, gen.lm_head, cfg, checkpoint=ckpt)
    gen.hf_model.cpu()  # the heads share its lm_head: saving and held-out accuracies run on the CPU
    heads = res.heads
    recipe = {
        "recipe": {**cfg.__dict__, "train_prompts": len(replies), "train_tokens": data.num_tokens,
                   "data": args.prompt_file, "caps": _caps(args.cap), "holdout": args.holdout,
                   "max_new_tokens": args.max_new_tokens, "samples": args.samples,
                   "temperature": args.temperature if args.samples > 1 else None, "device": args.device,
                   "replies": {"greedy": sum(not is_sampled(r.id) for r in replies),
                               "sampled": sum(is_sampled(r.id) for r in replies)},
                   "loss": "sum_k 0.8^k CE(head k, token t+k+1)",
                   "init": "seeds/001 §2.1.1: zero residual block, projection = the frozen shared lm_head",
                   "train_seconds": round(res.seconds, 1),
                   "total_seconds": round(time.perf_counter() - t_start, 1),
                   "final": res.history[-1] if res.history else None},
        "backbone": gen.source,
        "command": "medusa-export " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
    }
    save_heads(heads, args.out, extra=recipe)
    if held_replies:
        from ..training.calibrate import head_accuracies, save_accuracies

        acc = head_accuracies(heads, [h.float() for h in load_hidden(cache / "train", held_replies)],
                              [r.tokens for r in held_replies])
        save_accuracies(acc, args.out, source=f"held-out split of the training prompts ({len(held_replies)} prompts)",
                        positions=sum(len(r.tokens) for r in held_replies))
        print("held-out top-1 per head: " + ", ".join(f"{a:.3f}" for a in acc[:, 0]), file=sys.stderr)
    print(f"heads written to {args.out} (train {res.seconds / 60:.1f} min, total "
          f"{(time.perf_counter() - t_start) / 60:.1f} min)", file=sys.stderr)
    return 0


def cmd_calibrate(args) -> int:
    """Measure a_k^(i) on held-out prompts, save accuracies.json beside the heads, print trees."""
    from medusa_runtime.tree import expected_accept_length, greedy_tree

    from ..loading.registry import entry_for, load_entry_heads
    from ..training.calibrate import calibrate, save_accuracies, simulate_acceptance
    from ..training.distill import load_generator

    gen = load_generator(args.model, model_path=args.model_path)
    entry, _ = entry_for(args.model)
    heads, source, heads_dir = load_entry_heads(entry, gen.loaded, args.heads, lm_head=gen.lm_head)
    if heads is None:
        raise MedusaError(f"{args.model} has no trained heads to calibrate (its heads would be the untrained "
                          "initial ones); give --heads DIR")
    if args.out is None and entry.heads["source"] in ("hf", "backbone") and not args.heads:
        raise MedusaError(f"the heads of {args.model} come from {source}; give --out DIR for accuracies.json "
                          "(the Hugging Face cache is not written to)")
    prompts = _prompts(require(args.prompt_file, "--prompt-file"))[: args.limit or None]
    res = calibrate(gen, heads, prompts, Path(args.cache) / "calibrate", max_new_tokens=args.max_new_tokens,
                    batch_size=args.batch_size, topk=args.topk)
    out = args.out or (heads_dir if heads_dir.is_dir() else heads_dir.parent)
    save_accuracies(res.accuracies, out, source=", ".join(args.prompt_file), positions=res.positions)
    print("top-1 accuracy per head: " + ", ".join(f"{a:.3f}" for a in res.accuracies[:, 0]))
    print(f"{'nodes':>6} {'depth':>5} {'expected':>9} {'simulated':>9}")
    for budget in args.budgets:
        tree = greedy_tree(budget, res.accuracies)
        sim = simulate_acceptance(res.tokens, res.topk_ids, tree, max_new_tokens=args.max_new_tokens - 5)
        print(f"{tree.size:>6} {tree.max_depth:>5} {expected_accept_length(tree, res.accuracies):>9.3f} {sim:>9.3f}")
    print(f"accuracies written to {Path(out) / 'accuracies.json'}")
    return 0


def add_heads_commands(sub) -> None:
    """Register ``train-heads`` and ``calibrate``."""
    from ..training.distill import TrainConfig

    d = TrainConfig()
    p = sub.add_parser("train-heads", help="train Medusa heads on a frozen backbone (self-distillation)",
                       description="The backbone answers the prompts greedily with its chat template (batched); "
                                   "the heads learn on its cached hidden states with loss sum_k 0.8^k CE "
                                   "(Medusa-1). Resumable: replies, hidden states and training checkpoints are "
                                   "cached under --cache.")
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
    p.add_argument("--batch-size", type=int, default=32, help="generation batch (default: 32)")
    p.add_argument("--max-new-tokens", type=int, default=384, help="reply length cap (default: 384)")
    p.add_argument("--sort-window", type=int, default=2,
                   help="sort prompts by length within windows of this many batches (default: 2)")
    p.add_argument("--budget-tokens", type=int, help="stop generating once the cache holds this many reply tokens")
    p.add_argument("--max-tokens", type=int, help="train on only the first N cached reply tokens")
    p.add_argument("--generate-only", action="store_true", help="fill the caches and stop")
    p.add_argument("--exclude", action="append", default=[], metavar="JSONL",
                   help="prompts never answered or trained on, matched by id (repeatable; e.g. the "
                        "calibration prompts given to 'calibrate')")
    p.add_argument("--part", default="0/1", metavar="I/N",
                   help="answer only every N-th prompt from the I-th: run N processes (--generate-only, "
                        "OMP_NUM_THREADS=1 each) side by side on the same cache, then train without --part "
                        "(default: 0/1)")
    p.add_argument("--samples", type=int, default=1,
                   help="replies per training prompt: the greedy one plus N-1 sampled at --temperature, more "
                        "self-distillation text from few prompts (default: 1)")
    p.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled replies (default: 0.7)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda or cuda:N: where generation, teacher targets and training run (default: cpu)")
    p.add_argument("--num-heads", type=int, default=d.num_heads, help=f"K (default: {d.num_heads})")
    p.add_argument("--num-layers", type=int, default=d.num_layers, help=f"residual blocks per head (default: {d.num_layers})")
    p.add_argument("--epochs", type=float, default=d.epochs, help=f"(default: {d.epochs})")
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help=f"positions per step (default: {d.batch_tokens})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default: {d.lr})")
    p.add_argument("--soft-topk", type=int, default=d.soft_topk,
                   help=f"soft targets: the backbone's top-S distribution; 0 = hard labels (default: {d.soft_topk})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"(default: {d.seed})")
    p.set_defaults(func=cmd_train_heads)

    p = sub.add_parser("calibrate", help="measure the heads' top-i accuracies (tree building, seeds/001 §2.3.3)",
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
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64],
                   help="tree sizes to report (default: 4 8 16 32 64)")
    p.set_defaults(func=cmd_calibrate)
