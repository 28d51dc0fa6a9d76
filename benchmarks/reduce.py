"""Benchmark: a per-token reduction of every state kept (`watch(reduce=...)`) against the unhooked forward, in one run.

    python benchmarks/reduce.py                          # gdn and mamba2 at T = 2048, 3 rounds, memory too
    python benchmarks/reduce.py --tokens 512 --models gdn --rows unhooked,chunks
    python benchmarks/reduce.py --quick                  # tiny dims, T = 64, seconds

Models as in benchmarks/run.py (random weights, 2 recurrent layers, vocab 1024, batch 1, float32, `use_cache=False`,
no gradients): `gdn`, Qwen3.5 layer dims (hidden 2048, 16 key / 32 value heads of 128, MLP 6144); `mamba2`,
mamba2-130m layer dims (hidden 768, 24 heads of 64, d_state 128, 1 group, chunk 256); `mamba1` (`--models mamba1`),
mamba-130m dims (d_inner 1536, d_state 16: its all-states kernel runs the token loop there, gathering the states into
a chunk buffer). The reduction is the per-token norm `s.flatten(2).norm(dim=-1)`. Rows:
- "unhooked": `model(ids)`, the reference;
- "chunks": the reduction as the library runs it: the chunk-wise reductions (`Strategy.CHUNKS`: the all-states
  kernel once over the call, each 16-token chunk of states handed to the norm in one reused buffer);
- "blocks": the same reduction forced through the blocks path (`Paths(force="blocks")`, what ran before: 64-token
  blocks of states handed over token by token, copied and stacked for the norm).

Time: each row in a pass of its own with the unhooked forward, the two interleaved round by round after a warm-up
round (a row run between two others, blocks' hundreds of MB of buffers, was seen to perturb the next); a row's ratio
is its time over the unhooked forward's in the same round, median over rounds (range: the smallest and largest).
Target: chunks <= 1.3 x.
Memory: each row once in a child process, as benchmarks/run.py measures it (`MEMORY_NOTE` there: glibc returns every
tensor over 64 KiB to the OS when freed, so RSS follows the live tensors): peak+ = VmHWM during the row - VmRSS
before it; added = the row's peak+ - the unhooked row's. Target: added <= the reduction's bytes + one chunk's states
(16 tokens of one layer's state: the layers run one after the other).
"""

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from run import LINEAR2, MB, VOCAB, _gdn, _mamba1, _mamba2, _ready, _reset_peak, _status

import recurrent_hooks as rh
from recurrent_hooks.engine.paths.costs import STATES_CHUNK

MODELS = {
    "gdn": lambda: _gdn(2048, 16, 32, 128, 6144, LINEAR2),
    "mamba2": lambda: _mamba2(768, 24, 64, 128, 256),
    "mamba1": lambda: _mamba1(768, 16),  # not in the default run: its all-states kernel is the token loop at these dims
}
QUICK = {
    "gdn": lambda: _gdn(64, 2, 4, 16, 128, LINEAR2),  # 4 heads of 16 x 16
    "mamba2": lambda: _mamba2(64, 4, 32, 16, 16),  # 4 heads of 32 x 16
    "mamba1": lambda: _mamba1(64, 8),
}
TIME_TARGET = 1.3


def norm(states):
    """Each token's state norm, `[batch, chunk, *state] -> [batch, chunk]`."""
    return states.flatten(2).norm(dim=-1)


def _rows(model):
    def unhooked(ids):
        return {"out": model(ids, use_cache=False).logits}

    def reduced(paths):
        def run(ids):
            with rh.watch(model, keep=("states",), reduce={"states": norm}, paths=paths) as w:
                out = model(ids, use_cache=False).logits
            return {
                "out": out,
                "norms": [m.states for m in w.mixers],
                "paths": sorted({part.path for m in w.mixers for part in m.calls[0].kernel_calls}),
            }

        return run

    return {"unhooked": unhooked, "chunks": reduced(None), "blocks": reduced(rh.Paths(force="blocks"))}


def _state_bytes(model):
    """Bytes of one token's state, per layer (a 2-token forward keeping every state)."""
    with torch.no_grad(), rh.watch(model, keep=("states",)) as w:
        model(torch.randint(3, VOCAB, (1, 2)), use_cache=False)
    return [m.state_after(0).nbytes for m in w.mixers]


def time_rows(rows, ids, rounds):
    """Each row against the unhooked forward, in a pass of its own (`rounds` rounds of the two, interleaved, after a
    warm-up round): a row that leaves the allocator in another state (blocks: hundreds of MB of blocks and copies)
    then perturbs no other row. Returns, per row, its times and the unhooked forward's in the same rounds."""
    times, paths = {}, {}
    with torch.no_grad():
        for name in [name for name in rows if name != "unhooked"] or ["unhooked"]:
            pair = {"unhooked": rows["unhooked"], name: rows[name]}
            times[name] = ([], [])
            for round_ in range(rounds + 1):  # round 0 is a warm-up
                for key, run in pair.items():
                    gc.collect()
                    start = time.perf_counter()
                    result = run(ids)
                    elapsed = time.perf_counter() - start
                    paths[key] = result.get("paths", ["bound kernel"])
                    del result
                    if round_:
                        times[name][key == "unhooked"].append(elapsed)
    first = next(iter(times))
    return {
        "unhooked": (times[first][1], times[first][1]),
        **{k: v for k, v in times.items() if k != "unhooked"},
    }, paths


def memory_child(args) -> None:
    """Inside the child process: each row's peak+ (MB) per model, as JSON on the last line."""
    torch.set_num_threads(args.threads)
    out = {}
    for key in args.models.split(","):
        model = _ready((QUICK if args.quick else MODELS)[key])
        ids = torch.randint(3, VOCAB, (1, args.tokens), generator=torch.Generator().manual_seed(1))
        rows = {name: run for name, run in _rows(model).items() if name in args.rows.split(",")}
        out[key] = {}
        with torch.no_grad():
            for run in rows.values():
                del_me = run(ids[:, :16])  # warm-up: allocator pools, first-call costs
                del del_me
            for name, run in rows.items():
                gc.collect()
                before = _status("VmRSS")
                _reset_peak()
                result = run(ids)
                out[key][name] = (_status("VmHWM") - before) / MB
                del result
        del model, rows
        gc.collect()
    print(json.dumps(out))


def run_memory_child(args):
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--memory-child",
        "--models",
        args.models,
        "--rows",
        args.rows,
        "--tokens",
        str(args.tokens),
        "--threads",
        str(args.threads),
    ] + (["--quick"] if args.quick else [])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", MALLOC_ARENA_MAX="2")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print("memory child failed: " + " | ".join(proc.stderr.strip().splitlines()[-3:]))
        return {}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(key, tokens, times, paths, memory, state_bytes, layers):
    reduction = layers * tokens * 4  # one float32 norm per token, batch 1, per layer
    chunk = STATES_CHUNK * max(state_bytes)
    print(
        f"{key}: T={tokens}, batch 1, {layers} layers, a state of {max(state_bytes) / MB:.2f} MiB a token a layer;"
        f" unhooked forward median {statistics.median(times['unhooked'][0]):.3f} s"
    )
    print(f"  {'row':10s} {'ratio':>6s} {'range':>11s} {'median s':>9s} {'peak+ MB':>9s} {'added MB':>9s}  path")
    for name, (ts, reference) in times.items():
        ratios = [t / u for t, u in zip(ts, reference)]
        peak = memory.get(name)
        added = None if peak is None or "unhooked" not in memory else peak - memory["unhooked"]
        print(
            f"  {name:10s} {statistics.median(ratios):6.2f} {min(ratios):5.2f}-{max(ratios):<5.2f}"
            f" {statistics.median(ts):9.3f} {'-' if peak is None else f'{peak:9.1f}':>9s}"
            f" {'-' if added is None else f'{added:9.1f}':>9s}  {', '.join(paths[name])}"
        )
    if "chunks" in times:
        ratio = statistics.median(t / u for t, u in zip(*times["chunks"]))
        print(
            f"  chunks time: {ratio:.2f} x the forward, target <= {TIME_TARGET}:"
            f" {'met' if ratio <= TIME_TARGET else 'NOT met'}"
        )
    if "chunks" in memory and "unhooked" in memory:
        added, allowed = memory["chunks"] - memory["unhooked"], (reduction + chunk) / MB
        print(
            f"  chunks memory added: {added:.1f} MB, target <= the reduction ({reduction / MB:.3f} MB) + one chunk's"
            f" states ({chunk / MB:.1f} MB) = {allowed:.1f} MB: {'met' if added <= allowed else 'NOT met'}"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gdn,mamba2")
    parser.add_argument("--rows", default="unhooked,chunks,blocks", help="comma-separated, unhooked first")
    parser.add_argument("--tokens", type=int, default=None, help="T (default 2048; 64 with --quick)")
    parser.add_argument("--rounds", type=int, default=3, help="timed interleaved rounds (+1 warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny dims: a smoke run of seconds")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory child process")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.tokens = args.tokens or (64 if args.quick else 2048)
    if args.memory_child:
        memory_child(args)
        return
    torch.set_num_threads(args.threads)
    print(
        f"recurrent_hooks reduce benchmark: torch {torch.__version__}, CPU, {args.threads} threads, float32, no_grad,"
        f" {args.rounds} rounds; load average (1 min) {os.getloadavg()[0]:.2f}"
    )
    results = []
    for key in args.models.split(","):
        model = _ready((QUICK if args.quick else MODELS)[key])
        ids = torch.randint(3, VOCAB, (1, args.tokens), generator=torch.Generator().manual_seed(1))
        rows = {name: run for name, run in _rows(model).items() if name in args.rows.split(",")}
        state_bytes = _state_bytes(model)
        times, paths = time_rows(rows, ids, args.rounds)
        results.append((key, times, paths, state_bytes))
        del model, rows
        gc.collect()
    memory = {} if args.no_memory else run_memory_child(args)
    for key, times, paths, state_bytes in results:
        report(key, args.tokens, times, paths, memory.get(key, {}), state_bytes, len(state_bytes))
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
