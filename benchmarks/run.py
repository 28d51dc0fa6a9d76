"""Overhead benchmark of recurrent_hooks: hooked forwards and generates vs the unhooked model.

    python benchmarks/run.py                 # full run (CPU, a few minutes)
    python benchmarks/run.py --quick         # smoke run, tiny dims, a few seconds
    python benchmarks/run.py --repeats 5 --models gdn,mamba1
    python benchmarks/run.py --models mamba2_full,qwen3_5_slice --repeats 1   # full depth, T = 256 (slow)

Every model is built from a config with random weights (nothing is downloaded). Times are the median
over interleaved rounds (each round runs every row of a model once, round-robin) of the row's time
divided by the reference's time in the same round. Memory is measured in a separate child process
(see `MEMORY_NOTE`). `main(argv)` runs everything; importing this module does no work.

The studies at real layer dims have their own scripts, built on this one's models: attribution and
gradients to every kept state against a plain forward + backward, `benchmarks/attribution.py` (`--model
gdn_small | qwen3_5 | mamba2_130m`, `--tokens 2048`, `--device cuda`); the patching sweep's memory and time per
cell, `benchmarks/sweep.py --memory | --per-cell [--dims qwen3_5]`. The keep-with-a-reduction row is here.
"""

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

MB = 1024 * 1024

TIME_NOTE = """\
time: median over R interleaved rounds (+1 untimed warm-up round) of t(row) / t(reference) in the same
  round; rounds run every row of a model once, round-robin. Reference: the unhooked forward
  (model(ids, use_cache=False)) for forward rows, plain greedy generate for the generate row.
  Each timed row includes entering and leaving its watch and registering its hooks/writes."""

MEMORY_NOTE = """\
memory: measured once per row in a child process started with MALLOC_MMAP_THRESHOLD_=65536, so that
  glibc hands every tensor over 64 KiB straight back to the OS when it is freed and RSS follows the
  live tensors. Before each row: gc, read VmRSS, reset the kernel's peak (echo 5 > /proc/self/clear_refs).
  peak+ = VmHWM during the row - VmRSS before it (transient activations included);
  kept+ = VmRSS right after the row, with its results still referenced (the watch, what it kept, the
  returned states) - VmRSS before it; states = bytes of the states the row returns (exact).
  Sparse-read memory target: max(peak+, kept+) of the 8-position read row minus that of the idle-watch
  row (what the reads add), and minus that of the unhooked row (the watch's own bookkeeping included),
  each <= 1.1 x states. A small warm-up (16 tokens) of every row runs before the measurements."""


# -- models ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Spec:
    """One benchmarked model: what it is, its sequence length, and how to build it."""

    key: str
    label: str
    tokens: int
    new_tokens: int
    build: Callable[[], Any]  # the forward model (all layers recurrent)
    build_gen: Callable[[], Any] | None = None  # the generate model if it differs (None: the same)
    gen_note: str = ""
    all_states: bool = False  # also time keep=("states",) (every token)
    layers: int = 2  # decoder layers of the forward model (the report's header)


VOCAB = 1024  # small on purpose: a big LM head would dilute the ratios (and is not what the hooks touch)


def _gdn(hidden: int, key_heads: int, value_heads: int, head_dim: int, intermediate: int, layers: list[str]) -> Any:
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=len(layers),
        layer_types=layers,
        num_attention_heads=max(2, hidden // 128),
        num_key_value_heads=2 if hidden >= 256 else 1,
        head_dim=min(128, hidden // 2),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.Qwen3_5ForCausalLM(config)


def _mamba2(hidden: int, heads: int, head_dim: int, state: int, chunk: int, layers: int = 2) -> Any:
    import transformers

    config = transformers.Mamba2Config(
        vocab_size=VOCAB,
        hidden_size=hidden,
        num_heads=heads,
        head_dim=head_dim,
        expand=2,
        state_size=state,
        n_groups=1,
        chunk_size=chunk,
        conv_kernel=4,
        num_hidden_layers=layers,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.Mamba2ForCausalLM(config)


def _mamba1(hidden: int, state: int) -> Any:
    import transformers

    config = transformers.MambaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        expand=2,
        state_size=state,
        conv_kernel=4,
        num_hidden_layers=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.MambaForCausalLM(config)


LINEAR2 = ["linear_attention", "linear_attention"]
HYBRID = ["linear_attention", "full_attention"]
QWEN3_5_SLICE = (["linear_attention"] * 3 + ["full_attention"]) * 2
GDN_GEN_NOTE = (
    "generate: layers [linear, full] (transformers 5.24 fails to generate with a cache when every"
    " layer is linear), so it has 1 recurrent layer"
)


def specs(quick: bool) -> list[Spec]:
    """The benchmarked models; `quick` shrinks dims and lengths to a smoke test."""
    if quick:
        return [
            Spec(
                "gdn",
                "gated DeltaNet (quick dims)",
                64,
                8,
                lambda: _gdn(64, 2, 4, 16, 128, LINEAR2),
                lambda: _gdn(64, 2, 4, 16, 128, HYBRID),
                GDN_GEN_NOTE,
            ),
            Spec("mamba2", "Mamba-2 (quick dims)", 64, 8, lambda: _mamba2(64, 4, 32, 16, 16)),
            Spec("mamba1", "Mamba-1 (quick dims)", 64, 8, lambda: _mamba1(64, 8)),
            Spec(
                "gdn_small",
                "small gated DeltaNet (quick)",
                32,
                8,
                lambda: _gdn(64, 2, 4, 16, 128, LINEAR2),
                lambda: _gdn(64, 2, 4, 16, 128, HYBRID),
                GDN_GEN_NOTE,
                all_states=True,
            ),
        ]
    return [
        Spec(
            "gdn",
            "gated DeltaNet, Qwen3.5/Qwen3-Next layer dims: hidden 2048, 16 key / 32 value heads of 128, MLP 6144",
            2048,
            32,
            lambda: _gdn(2048, 16, 32, 128, 6144, LINEAR2),
            lambda: _gdn(2048, 16, 32, 128, 6144, HYBRID),
            GDN_GEN_NOTE,
        ),
        Spec(
            "mamba2",
            "Mamba-2, mamba2-130m dims: hidden 768, 24 heads of 64, state 128, chunk 256",
            2048,
            32,
            lambda: _mamba2(768, 24, 64, 128, 256),
        ),
        Spec(
            "mamba1", "Mamba-1, mamba-130m dims: hidden 768, d_inner 1536, state 16", 2048, 32, lambda: _mamba1(768, 16)
        ),
        Spec(
            "gdn_small",
            "small gated DeltaNet: hidden 256, 4 key / 8 value heads of 64, MLP 512",
            512,
            32,
            lambda: _gdn(256, 4, 8, 64, 512, LINEAR2),
            lambda: _gdn(256, 4, 8, 64, 512, HYBRID),
            GDN_GEN_NOTE,
            all_states=True,
        ),
        # full depth (not in the default --models): the 2-layer rows above understate what a real model costs
        Spec(
            "mamba2_full",
            "Mamba-2 at mamba2-130m's full depth: 24 layers of the mamba2 row's dims",
            256,
            8,
            lambda: _mamba2(768, 24, 64, 128, 256, layers=24),
            layers=24,
        ),
        Spec(
            "qwen3_5_slice",
            "a Qwen3.5 slice: 8 layers of the gdn row's dims in Qwen3.5's 3:1 pattern (6 gated DeltaNet, 2 attention)",
            256,
            8,
            lambda: _gdn(2048, 16, 32, 128, 6144, QWEN3_5_SLICE),
            layers=len(QWEN3_5_SLICE),
        ),
    ]


def _ready(build: Callable[[], Any]) -> Any:
    import torch

    torch.manual_seed(0)
    model = build().eval()
    model.generation_config.eos_token_id = None  # always generate the requested number of tokens
    return model


def positions(tokens: int) -> list[int]:
    """8 positions spread over the sequence (the middle of each eighth)."""
    return sorted({min(tokens - 1, int((i + 0.5) * tokens / 8)) for i in range(8)})


# -- the sparse-keep probe ------------------------------------------------------------------------------------


def probe_sparse() -> tuple[bool, str]:
    """Whether `watch(model, keep={"states": positions})` keeps only those positions (on a tiny model)."""
    import torch

    import recurrent_hooks as rh

    model = _ready(lambda: _gdn(32, 2, 2, 8, 64, LINEAR2))
    ids = torch.randint(3, VOCAB, (1, 6))
    try:
        with torch.no_grad(), rh.watch(model, keep={"states": [1, 3]}) as w:
            model(ids, use_cache=False)
        w.mixers[0].state_after(3)
    except Exception as exc:  # noqa: BLE001 - any failure means the sparse path is not there
        return False, f"keep={{'states': positions}} raised {type(exc).__name__}: {exc}"[:300]
    try:
        w.mixers[0].state_after(2)
    except rh.Unavailable:
        return True, "keep={'states': positions} keeps only the requested positions"
    return False, "keep={'states': positions} was accepted but kept every token (no sparse path)"


# -- rows -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    key: str
    label: str
    run: Callable[[Any], Any]  # ids -> result (kept referenced for the memory measurement)
    reference: str  # key of the row it is divided by
    target: float | None = None
    note: str = ""
    floor: bool = False  # also divided by the "floor" row: the forward plus writing every state's bytes once
    floor_target: float | None = None
    times: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None
    memory: dict[str, float] | None = None


def _state_bytes(result: Any) -> int:
    states = result.get("states", []) if isinstance(result, dict) else []
    return sum(t.numel() * t.element_size() for t in states)


def _per_token_norm(states: Any) -> Any:
    """The reduction the "reduce" row keeps: each token's state norm, `[batch, chunk, *state] -> [batch, chunk]`."""
    return states.flatten(2).norm(dim=-1)


FLOOR_BUFFER = 256 * MB  # the floor's destination: larger than any cache, reused from its start when it is full


def state_writer(shapes: list[tuple[int, ...]], tokens: int, device: Any = "cpu") -> Callable[[], None]:
    """The write floor of a row that keeps or hands over every state: each mixer's per-token state (one tensor,
    left in cache as a kernel leaves the state it just formed) copied `tokens` times into the next slot of one
    preallocated buffer (`FLOOR_BUFFER`, wrapping around), in token order: every state's bytes written once."""
    import torch

    sources = [torch.randn(s, device=device).flatten() for s in shapes]
    size = max(x.numel() for x in sources)
    slots = max(1, FLOOR_BUFFER // (4 * size))
    buffer = torch.empty(min(slots, tokens * len(sources)), size, device=device)

    def write() -> None:
        slot = 0
        for _ in range(tokens):
            for source in sources:
                buffer[slot, : source.numel()].copy_(source)
                slot = (slot + 1) % buffer.shape[0]

    return write


def make_rows(spec: Spec, model: Any, gen_model: Any, keep_mode: str, all_states_budget: float) -> list[Row]:
    """The rows of one model. `keep_mode`: "sparse", "all" (fallback keep=("states",)) or auto by budget."""
    import torch

    import recurrent_hooks as rh

    pos = positions(spec.tokens)
    # what the mixers' states look like: a 2-token forward keeping every state (cheap)
    with torch.no_grad(), rh.watch(model, keep=("states",)) as w:
        model(torch.randint(3, VOCAB, (1, 2)), use_cache=False)
    shapes = [tuple(m.state_after(0).shape) for m in w.mixers]
    modules = [m.module for m in w.mixers]
    del w
    per_token = sum(4 * torch.Size(s).numel() for s in shapes)
    zeros = [torch.zeros(s) for s in shapes]
    fwd = dict(use_cache=False)
    gen = dict(max_new_tokens=spec.new_tokens, do_sample=False, pad_token_id=0)

    def unhooked(ids):
        return {"out": model(ids, **fwd).logits}

    write_states = state_writer(shapes, spec.tokens)

    def floor(ids):
        out = model(ids, **fwd).logits
        write_states()
        return {"out": out}

    def idle(ids):
        with rh.watch(model) as w:
            out = model(ids, **fwd).logits
        return {"out": out, "watch": w}

    read_note = ""
    if keep_mode == "sparse":

        def read8(ids):
            with rh.watch(model, keep={"states": pos}) as w:
                out = model(ids, **fwd).logits
            return {"out": out, "watch": w, "states": [m.state_after(p) for m in w.mixers for p in pos]}
    elif per_token * spec.tokens <= all_states_budget:
        read_note = "sparse keep missing: fallback keep=('states',), then 8 state_after()"

        def read8(ids):
            with rh.watch(model, keep=("states",)) as w:
                out = model(ids, **fwd).logits
            return {"out": out, "watch": w, "states": [m.state_after(p) for m in w.mixers for p in pos]}
    else:
        read_note = (
            f"sparse keep missing; keep=('states',) would hold {per_token * spec.tokens / 2**30:.1f} GiB"
            " (> --all-states-budget): 8 hooks cloning the state instead"
        )

        def read8(ids):
            kept: list = []
            with rh.watch(model) as w:
                for m in w.mixers:
                    m.register_state_hook(lambda m_, c, t, s: kept.append(s.clone()), token=pos)
                out = model(ids, **fwd).logits
            return {"out": out, "watch": w, "states": kept}

    def write8(ids):
        with rh.watch(model) as w:
            for m, z in zip(w.mixers, zeros):
                for p in pos:
                    m.set_state_after(p, z)
            out = model(ids, **fwd).logits
        return {"out": out, "watch": w}

    def stream(ids):
        norms: list = []
        handles = [rh.register_state_hook(mod, lambda m_, c, t, s: norms.append(s.norm())) for mod in modules]
        try:
            out = model(ids, **fwd).logits
        finally:
            for h in handles:
                h.remove()
        return {"out": out, "norms": norms}

    def all_states(ids):
        with rh.watch(model, keep=("states",)) as w:
            out = model(ids, **fwd).logits
        # the states as kept (a list of references, no stacking copy)
        return {"out": out, "watch": w, "states": [m.state_after(t) for m in w.mixers for t in range(ids.shape[1])]}

    def reduced(ids):
        with rh.watch(model, keep=("states",), reduce={"states": _per_token_norm}) as w:
            out = model(ids, **fwd).logits
        return {"out": out, "watch": w, "norms": [m.states for m in w.mixers]}

    def generate(ids):
        return {"out": gen_model.generate(ids, **gen)}

    def generate_hook(ids):
        norms: list = []
        with rh.watch(gen_model) as w:
            for m in w.mixers:
                m.register_state_hook(lambda m_, c, t, s: norms.append(s.norm()), token=-1)
            out = gen_model.generate(ids, **gen)
        return {"out": out, "watch": w, "norms": norms}

    rows = [
        Row("unhooked", "unhooked forward", unhooked, "unhooked"),
        Row("floor", "write floor: unhooked forward + every state's bytes written once", floor, "unhooked"),
        Row("idle", "idle watch: with rh.watch(model): model(ids)", idle, "unhooked", 1.03),
        Row("read8", "8 positions read: keep={'states': 8 positions}", read8, "unhooked", 1.2, read_note),
        Row("write8", "8 positions written: set_state_after(t, zeros), 8 t, every mixer", write8, "unhooked", 1.2),
        Row(
            "stream",
            "per-token hook: rh.register_state_hook(norms.append(s.norm()))",
            stream,
            "unhooked",
            1.5,
            floor=True,
        ),
    ]
    if spec.all_states:
        rows.append(
            Row("all", "all-token states: keep=('states',)", all_states, "unhooked", floor=True, floor_target=1.3)
        )
    rows.append(
        Row("reduce", "keep with a per-token reduction: reduce={'states': norm}", reduced, "unhooked", 1.5, floor=True)
    )
    rows += [
        Row("gen", f"plain greedy generate, {spec.new_tokens} new tokens", generate, "gen", note=spec.gen_note),
        Row("gen_hook", "generate + per-step hook (token=-1) vs plain generate", generate_hook, "gen", 1.1),
    ]
    return rows


def _freeze() -> None:
    """Collect, then move every live object to gc's permanent generation: the gc.collect() before each
    row then costs milliseconds instead of the ~0.2 s a full pass over transformers' objects takes."""
    gc.collect()
    gc.freeze()


# -- timing ---------------------------------------------------------------------------------------------------


def time_rows(rows: list[Row], ids: Any, repeats: int, log: Callable[[str], None]) -> None:
    """Round 0 warms up; rounds 1..repeats time every row once, round-robin."""
    import torch

    for r in range(repeats + 1):
        log(f"  round {r}/{repeats}{' (warm-up)' if r == 0 else ''}")
        for row in rows:
            if row.error is not None:
                continue
            gc.collect()
            try:
                with torch.no_grad():
                    start = time.perf_counter()
                    result = row.run(ids)
                    elapsed = time.perf_counter() - start
            except Exception as exc:  # noqa: BLE001 - report the row, go on with the others
                row.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                continue
            del result
            if r > 0:
                row.times.append(elapsed)


def ratio(rows: list[Row], row: Row, reference: str | None = None) -> float | None:
    """Median over rounds of t(row) / t(reference) in the same round (the row's own reference by default)."""
    ref = next(r for r in rows if r.key == (reference or row.reference))
    if row.error or ref.error or not row.times or len(row.times) != len(ref.times):
        return None
    return statistics.median(a / b for a, b in zip(row.times, ref.times))


def ratio_range(rows: list[Row], row: Row) -> tuple[float, float] | None:
    """The smallest and largest per-round ratio (how noisy the median is)."""
    ref = next(r for r in rows if r.key == row.reference)
    if row.error or ref.error or not row.times or len(row.times) != len(ref.times):
        return None
    ratios = [a / b for a, b in zip(row.times, ref.times)]
    return min(ratios), max(ratios)


# -- memory (child process) -----------------------------------------------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure_memory(rows: list[Row], ids: Any) -> dict[str, dict[str, float]]:
    import torch

    warm = ids[:, :16]
    with torch.no_grad():
        for row in rows:
            try:
                del_me = row.run(warm)
                del del_me
            except Exception:  # noqa: BLE001 - the timing pass reports errors
                pass
        out: dict[str, dict[str, float]] = {}
        for row in rows:
            gc.collect()
            before = _status("VmRSS")
            _reset_peak()
            try:
                result = row.run(ids)
            except Exception as exc:  # noqa: BLE001
                out[row.key] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                continue
            peak = _status("VmHWM") - before
            kept = _status("VmRSS") - before
            out[row.key] = {"peak": peak / MB, "kept": kept / MB, "states": _state_bytes(result) / MB}
            del result
    return out


def memory_child(args: argparse.Namespace) -> None:
    """Runs inside the child process: measure every row of the chosen models, print JSON on the last line."""
    import torch

    torch.set_num_threads(args.threads)
    results = {}
    for spec in _chosen(args):
        model = _ready(spec.build)
        gen_model = model if spec.build_gen is None else _ready(spec.build_gen)
        ids = torch.randint(3, VOCAB, (1, spec.tokens), generator=torch.Generator().manual_seed(1))
        rows = make_rows(spec, model, gen_model, args.keep_mode, args.all_states_budget * 2**30)
        _freeze()
        results[spec.key] = measure_memory(rows, ids)
        del rows, model, gen_model
        gc.collect()
    print(json.dumps(results))


def run_memory_child(args: argparse.Namespace, keep_mode: str) -> tuple[dict | None, str]:
    try:
        _reset_peak()
        _status("VmHWM")
    except OSError as exc:
        return None, f"memory not measured: /proc peak RSS reset unavailable ({exc})"
    argv = [
        sys.executable,
        os.path.abspath(__file__),
        "--memory-child",
        "--keep-mode",
        keep_mode,
        "--threads",
        str(args.threads),
        "--models",
        args.models,
        "--all-states-budget",
        str(args.all_states_budget),
    ] + (["--quick"] if args.quick else [])
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0", MALLOC_ARENA_MAX="2")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return None, "memory child failed: " + " | ".join(proc.stderr.strip().splitlines()[-3:])
    return json.loads(proc.stdout.strip().splitlines()[-1]), ""


# -- report ---------------------------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _met(value: float | None, target: float | None) -> str:
    return "-" if target is None or value is None else ("yes" if value <= target else "NO")


def report(results: list[tuple[Spec, list[Row]]], memory: dict | None, header: list[str]) -> tuple[str, int]:
    lines = list(header)
    failures = 0
    cols = (
        f"{'row':<64} {'ratio':>6} {'range':>11} {'/floor':>6} {'target':>8} {'met':>4} {'median s':>8}"
        f" {'peak+ MB':>8} {'kept+ MB':>8} {'states MB':>9}"
    )
    for spec, rows in results:
        lines += ["", f"== {spec.key}: {spec.label}; T = {spec.tokens}, batch 1, {spec.layers} layers", cols]
        mem = (memory or {}).get(spec.key, {})
        for row in rows:
            r = ratio(rows, row)
            to_floor = ratio(rows, row, "floor") if row.floor else None
            if row.floor_target is not None:
                target, met = f"{row.floor_target:.2f} fl", _met(to_floor, row.floor_target)
            else:
                target, met = _fmt(row.target, ".2f"), _met(r, row.target)
            m = mem.get(row.key, {})
            median = statistics.median(row.times) if row.times and not row.error else None
            spread = ratio_range(rows, row)
            spread = "-" if spread is None else f"{spread[0]:.2f}-{spread[1]:.2f}"
            lines.append(
                f"{row.label[:64]:<64} {_fmt(r, '.2f'):>6} {spread:>11} {_fmt(to_floor, '.2f'):>6}"
                f" {target:>8} {met:>4}"
                f" {_fmt(median, '.3f'):>8} {_fmt(m.get('peak'), '.1f'):>8} {_fmt(m.get('kept'), '.1f'):>8}"
                f" {_fmt(m.get('states') or None, '.2f'):>9}"
            )
            if row.error:
                failures += 1
                lines.append(f"    ERROR: {row.error}")
            if row.note:
                lines.append(f"    note: {row.note}")
            if "error" in m:
                lines.append(f"    memory ERROR: {m['error']}")
        read = mem.get("read8", {})
        for ref, what in (
            ("unhooked", "the unhooked forward (the read keeps nothing else)"),
            ("idle", "the idle watch (which keeps nothing)"),
        ):
            base = mem.get(ref, {})
            if "peak" in read and "peak" in base:
                added = max(read["peak"] - base["peak"], read["kept"] - base["kept"])
                allowed = 1.1 * read["states"]
                lines.append(
                    f"sparse-read memory vs {what}: {added:+.1f} MB (peak+ {read['peak'] - base['peak']:+.1f},"
                    f" kept+ {read['kept'] - base['kept']:+.1f}); target <= 1.1 x states = {allowed:.1f} MB:"
                    f" {'met' if added <= allowed else 'NOT met'}"
                )
    return "\n".join(lines), failures


# -- main -----------------------------------------------------------------------------------------------------


def _library_version() -> str:
    """The library's git commit and whether its working tree has changes (it is measured as it is on disk)."""
    import recurrent_hooks

    root = os.path.dirname(os.path.dirname(os.path.abspath(recurrent_hooks.__file__)))
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--", "recurrent_hooks"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"{root} (no git)"
    if not head:
        return f"{root} (no git)"
    return f"{root} at {head}" + (" + uncommitted changes to recurrent_hooks/" if dirty else "")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny dims and lengths: a smoke run of a few seconds")
    p.add_argument("--repeats", type=int, default=3, help="timed interleaved rounds (default 3; +1 warm-up)")
    p.add_argument("--models", default="gdn,mamba2,mamba1,gdn_small", help="comma-separated subset")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default 2; 1 with --quick)")
    p.add_argument("--no-memory", action="store_true", help="skip the memory child process")
    p.add_argument(
        "--all-states-budget",
        type=float,
        default=4.0,
        help="GiB: without the sparse keep path, fall back to keep=('states',) only below this",
    )
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--keep-mode", default="sparse", help=argparse.SUPPRESS)
    return p


def _chosen(args: argparse.Namespace) -> list[Spec]:
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    table = {s.key: s for s in specs(args.quick)}
    unknown = [m for m in wanted if m not in table]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {list(table)}")
    return [table[m] for m in wanted]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table; 0 if every row ran (targets missed are reported, not errors)."""
    args = _parser().parse_args(argv)
    if args.threads is None:
        args.threads = 1 if args.quick else 2  # tiny --quick ops only lose from a second thread
    if args.memory_child:
        memory_child(args)
        return 0
    import torch

    threads = torch.get_num_threads()
    try:
        return _run(args)
    finally:  # leave a calling process (a test) as it was
        torch.set_num_threads(threads)
        gc.unfreeze()


def _run(args: argparse.Namespace) -> int:
    import torch

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    started, load_before = time.perf_counter(), os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    chosen = _chosen(args)
    sparse, sparse_note = probe_sparse()
    keep_mode = "sparse" if sparse else "fallback"
    results = []
    for spec in chosen:
        log(f"{spec.key}: building")
        model = _ready(spec.build)
        gen_model = model if spec.build_gen is None else _ready(spec.build_gen)
        ids = torch.randint(3, VOCAB, (1, spec.tokens), generator=torch.Generator().manual_seed(1))
        _freeze()
        try:
            rows = make_rows(spec, model, gen_model, keep_mode, args.all_states_budget * 2**30)
        except Exception as exc:  # noqa: BLE001 - the library may be mid-change: report it
            rows = [
                Row(
                    "unhooked",
                    "setting up the rows",
                    lambda ids: None,
                    "unhooked",
                    error=f"{type(exc).__name__}: {exc}".splitlines()[0][:200],
                )
            ]
        time_rows(rows, ids, args.repeats, log)
        results.append((spec, rows))
        del model, gen_model
        gc.collect()
    timing_done = time.perf_counter()
    memory, memory_note = (None, "memory not measured (--no-memory)") if args.no_memory else (None, "")
    if not args.no_memory:
        log("memory: child process")
        memory, memory_note = run_memory_child(args, keep_mode)
    import transformers

    header = [
        f"recurrent_hooks overhead benchmark{' (--quick)' if args.quick else ''}: torch {torch.__version__},"
        f" transformers {transformers.__version__}, CPU, {args.threads} threads, float32, no_grad, random weights,"
        f" vocab {VOCAB}, {args.repeats} rounds",
        f"recurrent_hooks: {_library_version()}",
        f"sparse keep path: {'present' if sparse else 'MISSING'} ({sparse_note})",
        TIME_NOTE.replace("R interleaved", f"{args.repeats} interleaved"),
        MEMORY_NOTE,
        "ratio: time / reference (median over rounds); range: smallest-largest per-round ratio;"
        " median s: the row's median seconds.",
        "/floor: time / the write floor's time (median over rounds), for the rows that keep or hand over every"
        " state: the floor is the unhooked forward plus every mixer's per-token state copied once into the next"
        f" slot of a preallocated {FLOOR_BUFFER // MB} MiB buffer (the bytes every state takes, written once);"
        " a target marked 'fl' is on that ratio.",
        f"load average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f}"
        " (other processes on the machine perturb the times; the interleaving spreads it over the rows)",
    ]
    if memory_note:
        header.append(memory_note)
    text, failures = report(results, memory, header)
    end = time.perf_counter()
    print(text)
    print(
        f"\nwall time: {end - started:.1f} s (timing {timing_done - started:.1f} s,"
        f" memory child {end - timing_done:.1f} s)"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
