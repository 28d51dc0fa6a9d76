"""Benchmark: the studies at real layer dims against a plain forward + backward of the same model, in one run.

    python benchmarks/attribution.py                      # gdn_small at T = 512
    python benchmarks/attribution.py --model qwen3_5      # Qwen3.5 layer dims, T = 512 (--tokens 2048)
    python benchmarks/attribution.py --model mamba2_130m  # mamba2-130m layer dims
    python benchmarks/attribution.py --model qwen3_5_4 --tokens 64 --pairs 8 --no-states   # many pairs at once
    python benchmarks/attribution.py --model mamba2_130m_full --tokens 256 --no-states   # full depth (24 layers)
    python benchmarks/attribution.py --device cuda        # the same rows on a GPU (fused kernels if installed)
    python benchmarks/attribution.py --quick              # tiny dims, a smoke run

Reference: "plain forward + backward": the corrupt ids' forward with gradients on and one backward of the
metric (log-sum-exp of the last token's logits) to the input embeddings (a leaf; the weights are frozen, as
in a study, so without it nothing would require grad). Rows, timed in interleaved rounds, each divided by the
reference of the same round (median over rounds):
- `rh.attribute(method="pieces")`: the default where the kind has it (nothing of size seq x state kept);
- `rh.attribute(method="states")`: every state and window kept differentiably (the reference path);
  skipped with --no-states (at Qwen3.5 dims it needs about 11 GB at T = 512);
- "gradients to every kept state": `watch(keep=("states",))` with gradients on, then one
  `autograd.grad(metric, [embeddings, every mixer's .states])` (the chunk-wise path of `engine.adjoint`).
Both attribution rows include the clean forward. Memory (CPU): each row once in a child process
(MALLOC_MMAP_THRESHOLD_=65536, as benchmarks/run.py: RSS follows the live tensors); peak+ = VmHWM during the
row - VmRSS before it. On another device: the accelerator's peak allocated bytes during the row
(`torch.cuda.max_memory_allocated`, CUDA only), in the same process.
The write floor: the reference plus every mixer's per-token state copied once into a preallocated buffer (the bytes
the states take, written once: `run.state_writer`); each row is also printed as a ratio to it (the gradients row
returns the states and their gradients, twice those bytes).
Targets: attribution time <= 3 x and memory <= 2 x the reference; gradients to every kept state
time <= 3 x.
"""

import argparse
import gc
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # this checkout's package, not an installed one
import run as bench  # noqa: E402  the benchmark's model builders and memory probes

import recurrent_hooks as rh  # noqa: E402

TIME_TARGET, MEMORY_TARGET = 3.0, 2.0
TIME_TARGETS = {"gradients to every kept state": 3.0}  # rows with their own target (else TIME_TARGET)
FLOOR = "write floor: forward + backward + every state written once"
MODELS = {  # name -> (label, builder)
    "gdn_small": (
        "gdn_small: hidden 256, 4 key / 8 value heads of 64, MLP 512, 2 gated DeltaNet layers",
        lambda: bench._gdn(256, 4, 8, 64, 512, bench.LINEAR2),
    ),
    "qwen3_5": (
        "Qwen3.5 layer dims: hidden 2048, 16 key / 32 value heads of 128, MLP 6144;"
        " one gated DeltaNet layer and one attention layer",
        lambda: bench._gdn(2048, 16, 32, 128, 6144, bench.HYBRID),
    ),
    "qwen3_5_4": (
        "Qwen3.5 layer dims in Qwen3.5's layer pattern: hidden 2048, 16 key / 32 value heads of 128,"
        " MLP 6144; three gated DeltaNet layers and one attention layer",
        lambda: bench._gdn(2048, 16, 32, 128, 6144, ["linear_attention"] * 3 + ["full_attention"]),
    ),
    "mamba2_130m": (
        "mamba2-130m layer dims: hidden 768, 24 heads of 64, state 128, chunk 256; 2 layers",
        lambda: bench._mamba2(768, 24, 64, 128, 256),
    ),
    "mamba2_130m_full": (
        "mamba2-130m at full depth: hidden 768, 24 heads of 64, state 128, chunk 256; 24 layers",
        lambda: bench._mamba2(768, 24, 64, 128, 256, layers=24),
    ),
    "qwen3_5_slice": (
        "a Qwen3.5 slice at its layer dims and 3:1 pattern: hidden 2048, 16 key / 32 value heads of 128,"
        " MLP 6144; 8 layers (6 gated DeltaNet, 2 attention)",
        lambda: bench._gdn(2048, 16, 32, 128, 6144, (["linear_attention"] * 3 + ["full_attention"]) * 2),
    ),
    "quick": ("gated DeltaNet (quick dims)", lambda: bench._gdn(64, 2, 4, 16, 128, bench.LINEAR2)),
}


def metric(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].logsumexp(-1)


def setup(args: argparse.Namespace):
    torch.manual_seed(0)
    label, build = MODELS["quick" if args.quick else args.model]
    device = torch.device(args.device)
    model = build().eval().requires_grad_(False).to(device)
    tokens = 32 if args.quick else args.tokens
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(3, bench.VOCAB, (args.pairs, tokens), generator=gen)
    corrupt = clean.clone()
    corrupt[:, tokens // 2] = (corrupt[:, tokens // 2] + 1) % bench.VOCAB
    clean, corrupt = clean.to(device), corrupt.to(device)

    def reference() -> None:
        embeds = model.get_input_embeddings()(corrupt).detach().requires_grad_()
        value = metric(model(inputs_embeds=embeds, use_cache=False).logits).sum()
        torch.autograd.grad(value, [embeds])

    def every_state() -> None:
        embeds = model.get_input_embeddings()(corrupt).detach().requires_grad_()
        with rh.watch(model, keep=("states",)) as w:
            value = metric(model(inputs_embeds=embeds, use_cache=False).logits).sum()
        torch.autograd.grad(value, [embeds, *(m.states for m in w.mixers)])

    with torch.no_grad(), rh.watch(model, keep=("states",)) as w:  # the states' shapes, from a 2-token forward
        model(corrupt[:, :2], use_cache=False)
    write_states = bench.state_writer([tuple(m.state_after(0).shape) for m in w.mixers], tokens, device)

    def floor() -> None:
        reference()
        write_states()

    rows = {"plain forward + backward": reference, FLOOR: floor}
    for method in ("pieces",) + (() if args.no_states else ("states",)):
        rows[f"rh.attribute(method={method!r})"] = lambda method=method: rh.attribute(
            model,
            clean,
            corrupt,
            metric,
            method=method,
            forward_kwargs={"use_cache": False},
            budget_bytes=args.budget_bytes,
        )
    if not args.no_gradients_row:
        rows["gradients to every kept state"] = every_state
    return label, tokens, rows


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def memory_child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    _, _, rows = setup(args)
    out = {}
    for name, run_row in rows.items():
        gc.collect()
        before = bench._status("VmRSS")
        bench._reset_peak()
        run_row()
        out[name] = (bench._status("VmHWM") - before) / bench.MB
        gc.collect()
    print(json.dumps(out))


def device_memory(args: argparse.Namespace, rows: dict) -> dict[str, float]:
    """Each row's peak allocated bytes above what was allocated before it, on a CUDA device (MB)."""
    device = torch.device(args.device)
    if device.type != "cuda":
        print(f"memory on {device.type}: not measured (CPU: a child process's RSS; CUDA: peak allocated bytes)")
        return {}
    out = {}
    for name, run_row in rows.items():
        gc.collect()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run_row()
        torch.cuda.synchronize(device)
        out[name] = (torch.cuda.max_memory_allocated(device) - before) / bench.MB
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gdn_small")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--pairs", type=int, default=1, help="prompt pairs in one call (the reference: the same batch)")
    parser.add_argument("--no-gradients-row", action="store_true", help="leave out 'gradients to every kept state'")
    parser.add_argument("--budget-bytes", type=int, default=None, help="attribute's budget_bytes (default: its own)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-states", action="store_true")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="where the model runs (cpu, cuda, ...)")
    parser.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(args)
        return 0
    torch.set_num_threads(args.threads)
    label, tokens, rows = setup(args)
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    device = torch.device(args.device)
    for round_ in range(args.repeats + 1):
        for name, run_row in rows.items():
            _synchronize(device)
            start = time.perf_counter()
            run_row()
            _synchronize(device)
            if round_:  # the first round warms up
                seconds[name].append(time.perf_counter() - start)
    memory: dict[str, float] = {}
    if not args.no_memory and device.type != "cpu":
        memory = device_memory(args, rows)
    elif not args.no_memory:
        child = [
            sys.executable,
            os.path.abspath(__file__),
            "--memory-child",
            "--model",
            args.model,
            "--tokens",
            str(args.tokens),
            "--threads",
            str(args.threads),
            "--pairs",
            str(args.pairs),
        ]
        child += [] if args.budget_bytes is None else ["--budget-bytes", str(args.budget_bytes)]
        child += [
            f
            for f, on in (
                ("--quick", args.quick),
                ("--no-states", args.no_states),
                ("--no-gradients-row", args.no_gradients_row),
            )
            if on
        ]
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", MALLOC_ARENA_MAX="2")
        proc = subprocess.run(child, env=env, capture_output=True, text=True)
        if proc.returncode:
            print("memory child failed: " + " | ".join(proc.stderr.strip().splitlines()[-3:]))
        else:
            memory = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"{label}; T = {tokens}, {args.pairs} pair{'s' if args.pairs > 1 else ''}, {device}, {args.threads} threads,"
        f" {args.repeats} rounds (+1 warm-up)"
    )
    reference = "plain forward + backward"
    for name in rows:
        ratios = [a / b for a, b in zip(seconds[name], seconds[reference])]
        line = f"{name}: median {statistics.median(seconds[name]):.3f} s"
        if name == FLOOR:
            line += f", time ratio {statistics.median(ratios):.2f}"
        elif name != reference:
            ratio, target = statistics.median(ratios), TIME_TARGETS.get(name, TIME_TARGET)
            to_floor = statistics.median(a / b for a, b in zip(seconds[name], seconds[FLOOR]))
            line += (
                f", time ratio {ratio:.2f} (range {min(ratios):.2f}-{max(ratios):.2f}; target <= {target}:"
                f" {'met' if ratio <= target else 'NOT met'}), {to_floor:.2f} x the write floor"
            )
        if name in memory:
            line += f"; peak+ {memory[name]:.0f} MB"
            if name != reference and memory.get(reference) and name.startswith("rh.attribute"):
                mem_ratio = memory[name] / memory[reference]
                line += (
                    f" = {mem_ratio:.2f} x (target <= {MEMORY_TARGET}:"
                    f" {'met' if mem_ratio <= MEMORY_TARGET else 'NOT met'})"
                )
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
