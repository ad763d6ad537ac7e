"""``train-heads`` and ``calibrate`` sub-commands (registered by :func:`add_heads_commands`)."""

from __future__ import annotations

import shlex
import sys
from dataclasses import fields
from pathlib import Path

from medusa_runtime.tuning.autotree import DEFAULT_SIZES as AUTO_SIZES
from medusa_runtime.trees.dynamic import DEFAULT_WIDTH

from ..errors import MedusaError
from ..loading.registry import DEFAULT_MODEL
from .args import add_prompt_file_arg, require

#: The records training.distill.load_prompts reads, for --prompt-file's help.
DISTILL_PROMPT_FORMAT = "JSONL records with 'messages', 'turns', 'prompt', 'instruction' or OASST '### Human:' text"
#: Tree sizes ``calibrate`` simulates by default: those ``--tree auto`` tries (1, plain decoding, needs none).
CALIBRATED_SIZES = tuple(n for n in AUTO_SIZES if n > 1)



def _prompts(paths: list[str]):
    from ..training.pipeline import load_prompt_files

    return load_prompt_files(paths)


def cmd_train_heads(args) -> int:
    """``train-heads``: the flags as :class:`~medusa_export.training.pipeline.TrainHeadsOptions`, then the run."""
    from ..training.pipeline import TrainHeadsOptions, train_heads_run

    require(args.prompt_file, "--prompt-file")
    given = {f.name: getattr(args, f.name) for f in fields(TrainHeadsOptions) if f.name != "command"}
    given.update(prompt_file=tuple(args.prompt_file), cap=tuple(args.cap or ()), exclude=tuple(args.exclude or ()))
    train_heads_run(TrainHeadsOptions(**given, command="medusa-export " + " ".join(shlex.quote(a) for a in sys.argv[1:])))
    return 0


def cmd_calibrate(args) -> int:
    """Measure a_k^(i) and the probability map on held-out prompts, simulate static and per-step trees,
    save accuracies.json beside the heads."""
    import numpy as np
    from medusa_runtime.trees.dynamic import DynamicTree
    from medusa_runtime.trees.tree import expected_accept_length, greedy_tree

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
        from medusa_runtime.trees.calibration import ProbabilityMap

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
    from ..training.pipeline import DTYPES, TrainHeadsOptions

    d = TrainHeadsOptions(prompt_file=(), out="")  # the defaults
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
    p.add_argument("--holdout", type=int, default=d.holdout,
                   help="prompts answered but never trained on; the heads' accuracies on them go to accuracies.json "
                        "(default: 32)")
    p.add_argument("--out", required=True, help="output heads directory")
    p.add_argument("--cache", default=d.cache, help=f"cache directory (default: {d.cache})")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help=f"rows decoded together (default: {d.batch_size})")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help=f"reply length cap (default: {d.max_new_tokens})")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help=f"longer prompts are skipped (default: {d.max_prompt_tokens})")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype,
                   help="generation and feature recomputation dtype (default: bf16; fp32 is ~4x slower on a CPU)")
    p.add_argument("--threads", type=int,
                   help="PyTorch threads (default on a CPU: 1; several one-thread processes (--part) use more "
                        "cores better than threads on a shared machine; on an idle one, training gains from 2)")
    p.add_argument("--features-batch-tokens", type=int, default=d.features_batch_tokens,
                   help="padded tokens per teacher-forced pass when recomputing hidden states (default: 8192)")
    p.add_argument("--sort-window", type=int, default=d.sort_window,
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
    p.add_argument("--part", default=d.part, metavar="I/N",
                   help="answer only every N-th prompt from the I-th (and, with --features-only, compute every N-th "
                        "feature chunk): run N processes (one thread each) side by side on the same cache, then "
                        "train without --part (default: 0/1)")
    p.add_argument("--samples", type=int, default=d.samples,
                   help="replies per training prompt: the greedy one plus N-1 sampled at --temperature, more "
                        "self-distillation text from few prompts (default: 1)")
    p.add_argument("--temperature", type=float, default=d.temperature, help=f"temperature of the sampled replies (default: {d.temperature})")
    p.add_argument("--device", default=d.device,
                   help="cpu, cuda or cuda:N: where generation, teacher targets and training run (default: cpu)")
    p.add_argument("--head-type", choices=HEAD_TYPES, default=d.head_type,
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
    p.add_argument("--cache", default=d.cache, help=f"cache directory (default: {d.cache})")
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
