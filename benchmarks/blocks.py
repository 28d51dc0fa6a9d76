"""Benchmark: a per-token hook (state norm) through the token loop and through the blocks path, in one run.

    python benchmarks/blocks.py                  # gdn_small, mamba2 (T=512), tiny gdn and mamba2 (T=512), 3 rounds
    python benchmarks/blocks.py --models mamba2 --tokens 2048 --rounds 5 --blocks 32,64,128
    python benchmarks/blocks.py --quick          # tiny dims, T=64, seconds

Models as in benchmarks/run.py (random weights, 2 recurrent layers, `use_cache=False`, no gradients). Per model,
every round runs each row once, interleaved; a row's ratio is its time over the unhooked forward's in the same
round, and the median over rounds is printed with its range. Rows:
- "chosen": the hook as the library runs it (blocks where `Segments.blocks_below` allows, else the token loop);
- "loop": the hook through the token loop (`paths=rh.Paths(rule="loop")`, what main ran before the blocks path);
- "blocks B": the same hook through `_blocks.run_in_blocks` with `BLOCK = B`, forced (`Paths(force="blocks",
  blocks_below=2**62)`);
- "blocks B, no-op hook": a hook that reads nothing (returns None): the path's own cost, without the norms;
- "all_states once": the unhooked forward with its prompt kernel replaced by the chunk-wise `all_states` over the
  whole call (every state materialized once, no hook): the floor of any path that hands over every state.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from run import LINEAR2, VOCAB, _gdn, _mamba2, _ready

import recurrent_hooks as rh
import recurrent_hooks.engine.paths.blocks as rh_blocks

MODELS = {
    "gdn_small": (lambda: _gdn(256, 4, 8, 64, 512, LINEAR2), 512),
    "mamba2": (lambda: _mamba2(768, 24, 64, 128, 256), 512),
    "gdn": (lambda: _gdn(2048, 16, 32, 128, 6144, LINEAR2), 2048),
    "gdn_tiny": (lambda: _gdn(64, 2, 4, 16, 128, LINEAR2), 512),  # 4 heads of 16 x 16
    "mamba2_tiny": (lambda: _mamba2(64, 4, 32, 16, 16), 512),  # 4 heads of 32 x 16
}
QUICK = {key: (MODELS[key][0], 64) for key in ("gdn_tiny", "mamba2_tiny")}


def _rows(model, blocks):
    with torch.no_grad(), rh.watch(model) as w:
        pass
    modules = [m.module for m in w.mixers]
    kind = type(w.mixers[0])
    prompt = kind.kernel_for("prompt")
    modeling = sys.modules[type(modules[0]).__module__]

    def unhooked(ids):
        return model(ids, use_cache=False).logits

    def hooked(ids, fn, paths=None):
        handles = [rh.register_state_hook(mod, fn, paths=paths) for mod in modules]
        try:
            return model(ids, use_cache=False).logits
        finally:
            for h in handles:
                h.remove()

    norms = []

    def norm_hook(m, c, t, s):
        norms.append(s.norm())

    def loop(ids):
        return hooked(ids, norm_hook, rh.Paths(rule="loop"))

    def blocks_row(block, fn):
        def run(ids):
            saved = rh_blocks.BLOCK
            rh_blocks.BLOCK = block
            try:
                return hooked(ids, fn, rh.Paths(force="blocks", blocks_below=2**62))
            finally:
                rh_blocks.BLOCK = saved

        return run

    def all_states_once(ids):
        original = getattr(modeling, prompt.name)
        states_fn = prompt.segments.all_states

        def materialize(*args, **kwargs):
            return states_fn(*args, **kwargs)[0]

        setattr(modeling, prompt.name, materialize)
        try:
            return model(ids, use_cache=False).logits
        finally:
            setattr(modeling, prompt.name, original)

    rows = {"unhooked": unhooked, "chosen": lambda ids: hooked(ids, norm_hook), "loop": loop}
    for block in blocks:
        rows[f"blocks {block}"] = blocks_row(block, norm_hook)
    rows[f"blocks {blocks[-1]}, no-op hook"] = blocks_row(blocks[-1], lambda m, c, t, s: None)
    rows["all_states once"] = all_states_once
    return rows, norms


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gdn_small,mamba2,gdn_tiny,mamba2_tiny")
    parser.add_argument("--tokens", type=int, default=None, help="T (default: the model's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", default="32,64,128")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the shared machine oversubscribes 2)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    blocks = [int(b) for b in args.blocks.split(",")]
    table = QUICK if args.quick else MODELS
    for key in list(QUICK) if args.quick else args.models.split(","):
        build, tokens = table[key]
        tokens = args.tokens or tokens
        model = _ready(build)
        ids = torch.randint(3, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
        rows, norms = _rows(model, blocks)
        times = {name: [] for name in rows}
        with torch.no_grad():
            for round_ in range(args.rounds + 1):  # round 0 is a warm-up
                for name, run in rows.items():
                    start = time.perf_counter()
                    run(ids)
                    elapsed = time.perf_counter() - start
                    norms.clear()
                    if round_:
                        times[name].append(elapsed)
        print(
            f"{key}: T={tokens}, {args.rounds} rounds, {args.threads} thread(s), unhooked forward median "
            f"{statistics.median(times['unhooked']) * 1e3:.1f} ms"
        )
        for name, ts in times.items():
            ratios = [t / u for t, u in zip(ts, times["unhooked"])]
            print(f"  {name:28s} {statistics.median(ratios):6.2f}  (range {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
