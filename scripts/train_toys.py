"""Train an MQAR toy of recurrent_hooks.toys from a seed and write its weights (safetensors, float32).

    python scripts/train_toys.py gdn --seed 0 --steps 3000 --out recurrent_hooks/toys/weights/gdn.safetensors
    python scripts/train_toys.py gdn_recall --seed 0 --steps 2400 --stop-at 0.99 --out ...gdn_recall.safetensors
    python scripts/train_toys.py --tokenizer-only      # rewrite recurrent_hooks/toys/weights/tokenizer/, no training

The model is `build_toy(name, seed)` (transformers' init, then `init_for_recall`); the training data are
fresh `MQAR()` batches drawn from a generator seeded with `seed`, so a run is a function of its
arguments (and of torch's CPU kernels: same machine, same thread count, same result). AdamW, linear
warm-up then cosine decay, loss on the answers only. It prints the loss and the accuracy on 512
held-out prompts (seed 10**6 + seed) every `--every` steps, and the final accuracy on 2048 prompts.

Measured on this machine (2 CPU cores shared with other jobs, torch 2.13, transformers 5.24,
--threads 1, which was faster than 2 here), the runs that produced the shipped weights:

- gdn: ``python scripts/train_toys.py gdn --seed 0 --steps 3000 --every 200 --out ...``: 85,656
  parameters; held-out accuracy 22% at step 200, 32% at 400, 95.4% at 600, 99.6% at 1,000, 100% at
  3,000; 537 s (0.18 s/step); 100.00% of 2,048 fresh prompts' queries. File 345,512 bytes.
- mamba2: ``python scripts/train_toys.py mamba2 --seed 0 --steps 5000 --every 500 --out ...``: 58,672
  parameters; held-out accuracy 23% at step 500, 34% at 1,000, 92.5% at 1,500, 99.1% at 2,000,
  99.85% at 3,000, 100% at 5,000; 906 s (0.18 s/step, slower while the machine was busy); 100.00% of
  2,048 fresh prompts' queries. File 236,752 bytes. (An earlier 2,500-step run reached 84.8%.)
- mamba (not shipped): one step took 1.2 s here (the sequential selective scan), so no run fit.
- gdn_recall: ``python scripts/train_toys.py gdn_recall --seed 0 --steps 2400 --every 200 --threads 1
  --stop-at 0.99 --max-seconds 750 --out recurrent_hooks/toys/weights/gdn_recall.safetensors``:
  116,496 parameters (1,024 of them the frozen zero o_proj, not trained); held-out accuracy 25.8% at
  step 200, 94.3% at 400, 98.0% at 600, 98.6% at 800, 99.27% at 1,000, where ``--stop-at`` ended the
  run (the cosine schedule, set for 2,400 steps, was at 67% of the peak lr); 285 s (0.28 s/step,
  the third layer and a concurrent job make it slower than gdn); 99.26% of 2,048 fresh prompts'
  queries. File 470,360 bytes.

For a toy with a no-op attention (``gdn_recall``), `build_toy` zeroes ``self_attn.o_proj.weight``
and sets ``requires_grad=False``; only parameters that require grad go to AdamW and to gradient
clipping, so neither the update nor weight decay can move it, and the script checks it is still
zero before writing the file. ``--stop-at`` / ``--max-seconds`` end a run early (the metadata records
the steps done and the schedule's length).

Tokenizer: every run also writes the toys' tokenizer (``write_toy_tokenizer``: tokenizer.json and
tokenizer_config.json, the words of `MQAR()`'s vocabulary, which every toy shares) into a folder
``tokenizer/`` next to ``--out``. ``--tokenizer-only`` writes just those files, into
``--tokenizer-dir`` (default: the packaged ``recurrent_hooks/toys/weights/tokenizer``), without
training; tests/package/test_toys.py checks the packaged files equal what ``write_toy_tokenizer`` writes.

The runs were not repeated to check that they reproduce bit for bit; the accuracy does not hinge
on it (the tests check the shipped weights on a fresh seed).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recurrent_hooks.toys import MQAR, build_toy, write_toy_tokenizer  # noqa: E402

PACKAGED_TOKENIZER = Path(__file__).resolve().parents[1] / "recurrent_hooks" / "toys" / "weights" / "tokenizer"


def evaluate(model, task: MQAR, n: int, seed: int) -> float:
    model.eval()
    with torch.no_grad():
        batch = task.sample(n, seed=seed)
        acc = task.accuracy(model(batch.ids).logits, batch)
    model.train()
    return acc


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", help="toy name: gdn, gdn_recall, mamba2 (shipped), mamba (config only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--every", type=int, default=250, help="evaluate every this many steps")
    parser.add_argument("--decay-factor", type=float, default=64.0, help="init_for_recall's factor")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--stop-at",
        type=float,
        default=None,
        help="stop early once the held-out accuracy (every --every steps) reaches this",
    )
    parser.add_argument("--max-seconds", type=float, default=None, help="stop after this much training time")
    parser.add_argument("--out", type=Path, help="where to write the .safetensors file (and tokenizer/ beside it)")
    parser.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="write the toys' tokenizer files into --tokenizer-dir and exit, without training",
    )
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=PACKAGED_TOKENIZER,
        help="where --tokenizer-only writes (default: the packaged recurrent_hooks/toys/weights/tokenizer)",
    )
    args = parser.parse_args(argv)
    if args.tokenizer_only:
        for path in write_toy_tokenizer(args.tokenizer_dir, MQAR()):
            print(f"wrote {path} ({path.stat().st_size:,} bytes)", flush=True)
        return
    if args.model is None or args.out is None:
        parser.error("training needs a toy name and --out (or pass --tokenizer-only)")

    from safetensors.torch import save_file

    torch.set_num_threads(args.threads)
    task = MQAR()
    model = build_toy(args.model, args.seed, decay_factor=args.decay_factor)
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {type(model).__name__}, {params:,} parameters, {task}, seed {args.seed}", flush=True)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # not a frozen no-op o_proj
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        print(f"frozen (not trained): {frozen}", flush=True)
    decay = [p for n, p in trainable if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in trainable if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * (step - args.warmup) / max(1, args.steps - args.warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = task.sample(args.batch, generator=generator)
        loss = task.loss(model(batch.ids).logits, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, p in trainable], 1.0)
        optimizer.step()
        scheduler.step()
        if step % args.every == 0 or step == args.steps:
            acc = evaluate(model, task, 512, 10**6 + args.seed)
            print(
                f"step {step:5d}  loss {loss.item():.4f}  held-out acc {acc:.4f}  {time.perf_counter() - start:7.1f} s",
                flush=True,
            )
            if args.stop_at is not None and acc >= args.stop_at:
                print(f"stopping: held-out accuracy {acc:.4f} >= {args.stop_at}", flush=True)
                break
            if args.max_seconds is not None and time.perf_counter() - start >= args.max_seconds:
                print(f"stopping: {args.max_seconds} s of training", flush=True)
                break
    steps_done = step
    for name in frozen:  # a frozen no-op o_proj must still be zero
        value = dict(model.named_parameters())[name]
        if "o_proj" in name and torch.count_nonzero(value):
            raise RuntimeError(f"{name} is frozen at zero but is not zero")
    elapsed = time.perf_counter() - start
    acc = evaluate(model, task, 2048, 10**6 + args.seed + 1)
    print(f"done: {steps_done} steps in {elapsed:.1f} s; accuracy on 2048 fresh prompts {acc:.4f}", flush=True)

    state = {k: v.detach().float().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied to the input embedding: stored once
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        state,
        str(args.out),
        metadata={
            "toy": args.model,
            "seed": str(args.seed),
            "steps": str(steps_done),
            "schedule_steps": str(args.steps),
            "batch": str(args.batch),
            "lr": str(args.lr),
            "decay_factor": str(args.decay_factor),
            "accuracy_2048": f"{acc:.4f}",
            "train_seconds": f"{elapsed:.0f}",
        },
    )
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes)", flush=True)
    for path in write_toy_tokenizer(args.out.parent / "tokenizer", task, model.config.vocab_size):
        print(f"wrote {path} ({path.stat().st_size:,} bytes)", flush=True)


if __name__ == "__main__":
    main()
