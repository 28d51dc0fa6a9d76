"""Benchmark and calibration of the cost model that chooses a busy call's path
(`recurrent_hooks/engine/paths/choose.py`, `costs.py`).

    python benchmarks/paths.py               # the rows: each path's time, forced, and the one chosen
    python benchmarks/paths.py --quick       # a smoke run, a few seconds (run by the tests)
    python benchmarks/paths.py --calibrate   # time the kernels over a grid of shapes, fit and print the constants
    python benchmarks/paths.py --calibrate --write   # ... and write them into the package's costs.json, under
                                                     # this device type and dtype ("cpu/float32"; --device cuda)

Rows: a model forward (random weights, 2 recurrent layers, `torch.no_grad()`, 1 thread: see `--threads`) asked for
states at some positions. Each path is forced in turn (`watch(model, paths=rh.Paths(force=...))`; "segments" with the
token-loop tails on, `Paths(tails=True)`, "segments, whole" with them off, the default); the paths are timed in
interleaved rounds and each time is the median over the rounds, with the unhooked forward (no watch) timed in the same
rounds. "chosen" is the path the cost model picks for the row's calls; the check is that its time is within 10% of the
fastest path's. A path the call cannot take is "-"; "segments" is "segments, whole" again when no piece ends in a tail
(the chosen path is "segments" only when one does).

Calibration: each path of each kernel alone (the bound transformers kernel on a whole call, the library's
token loop with an identity `on_token`, the library's all-states kernel), best of 5 per shape; the
constants of each path come from a non-negative least-squares fit of its terms (`costs.kernel_terms` ...)
to the times, weighted by 1/time (a fit on relative error), and each fit's worst relative error on its own timings
is printed and written with the constants (how far the model is off). One torch thread by default: on this machine,
shared by several jobs, two threads contending for two cores made single timings vary by 100x.
"""

import argparse
import datetime
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # this checkout's package
import recurrent_hooks as rh  # noqa: E402
import recurrent_hooks.engine.paths.choose as rh_choose  # noqa: E402
import recurrent_hooks.engine.paths.costs as rh_costs  # noqa: E402
import recurrent_hooks.engine.policy as rh_policy  # noqa: E402
from recurrent_hooks.kinds.gated_delta_net import GatedDeltaNet  # noqa: E402
from recurrent_hooks.kinds.state_space import Mamba2StateSpace  # noqa: E402

VOCAB = 1024


# -- calibration --------------------------------------------------------------------------------------------------


def _gdn_call(batch: int, seq: int, heads: int, dim: int, chunk: int) -> tuple[Any, Callable, tuple, dict]:
    """The gated DeltaNet prompt kernel's row, the bound kernel, and a call's arguments."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, seq, heads, dim, generator=gen) for _ in range(3))
    g, beta = -torch.rand(batch, seq, heads, generator=gen), torch.rand(batch, seq, heads, generator=gen)
    kwargs = dict(
        initial_state=torch.zeros(batch, heads, dim, dim), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    return GatedDeltaNet.kernel_for("prompt"), modeling.torch_chunk_gated_delta_rule, (q, k, v, g, beta), kwargs


def _ssd_call(
    batch: int, seq: int, heads: int, dim: int, chunk: int, d_state: int = 0
) -> tuple[Any, Callable, tuple, dict]:
    """The Mamba-2 prompt kernel's row, the bound kernel, and a call's arguments (`dim`: head_dim; d_state = 2 dim
    unless given)."""
    import transformers.models.mamba2.modeling_mamba2 as modeling

    d_state = d_state or 2 * dim
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq, heads, dim, generator=gen)
    dt = torch.randn(batch, seq, heads, generator=gen)
    B, C = (torch.randn(batch, seq, 1, d_state, generator=gen) for _ in range(2))
    A = -torch.rand(heads, generator=gen)
    kwargs = dict(
        D=torch.ones(heads),
        dt_bias=torch.zeros(heads),
        initial_states=torch.zeros(batch, heads, dim, d_state),
        dt_softplus=True,
        return_final_states=True,
    )
    return Mamba2StateSpace.kernel_for("prompt"), modeling.mamba2_chunk_scan, (x, dt, A, B, C, chunk), kwargs


def _kimi_call(batch: int, seq: int, heads: int, dim: int, chunk: int) -> tuple[Any, Callable, tuple, dict]:
    """The Kimi delta attention prompt kernel's row, the bound kernel, and a call's arguments."""
    import transformers.models.kimi_linear.modeling_kimi_linear as modeling

    from recurrent_hooks.kinds.kimi_delta import KimiDeltaAttention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, seq, heads, dim, generator=gen) for _ in range(3))
    g, beta = -torch.rand(batch, seq, heads, dim, generator=gen), torch.rand(batch, seq, heads, generator=gen)
    kwargs = dict(
        initial_state=torch.zeros(batch, heads, dim, dim), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    return KimiDeltaAttention.kernel_for("prompt"), modeling.chunk_kimi_delta_attention, (q, k, v, g, beta), kwargs


CALLS = {"delta rule": _gdn_call, "ssd": _ssd_call, "kimi delta": _kimi_call}
# (batch, heads, dim, chunk) per kernel, and the lengths each path is timed at
GRID = {
    "delta rule": [
        (1, 4, 16, 64),
        (8, 4, 16, 64),
        (64, 4, 16, 64),
        (1, 8, 64, 64),
        (16, 8, 64, 64),
        (64, 8, 64, 64),
        (1, 32, 128, 64),
    ],
    "ssd": [
        (1, 4, 16, 16),
        (8, 4, 16, 16),
        (64, 4, 16, 16),
        (1, 8, 32, 64),
        (64, 8, 32, 64),
        (1, 24, 64, 256),
        (8, 24, 64, 256),
    ],
    "kimi delta": [(1, 4, 16, 64), (64, 4, 16, 64), (1, 8, 64, 64), (16, 8, 64, 64), (1, 32, 128, 64)],
}
LENGTHS = {"kernel": (25, 64, 200, 512), "loop": (16, 64), "states": (16, 64, 256)}
KERNEL_ELEMENTS = 2**27  # the bound kernel is timed up to batch * T * heads * k * v of this
STATES_BYTES = 128 * 2**20  # the all-states kernel is timed up to this many bytes of states
QUICK_GRID = {
    "delta rule": [(1, 4, 16, 64), (8, 4, 16, 64)],
    "ssd": [(1, 4, 16, 16), (8, 4, 16, 16)],
    "kimi delta": [(1, 4, 16, 64)],
}
QUICK_LENGTHS = {"kernel": (16, 40), "loop": (8, 16), "states": (16, 32)}


def _best(fn: Callable[[], Any], reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


TERMS = {"kernel": rh_costs.kernel_terms, "loop": rh_costs.loop_terms, "states": rh_costs.states_terms}


def nnls(a: torch.Tensor, b: torch.Tensor, iterations: int = 300) -> torch.Tensor:
    """x >= 0 minimising |a x - b|: Lawson and Hanson's active-set method ("Solving Least Squares Problems",
    1974, ch. 23), in float64. A variable enters the passive set where the gradient a^T (b - a x) is largest; the
    least-squares solution on the passive set is taken, stepping back to the boundary while any of it is <= 0."""
    columns = a.shape[1]
    x = torch.zeros(columns, dtype=a.dtype)
    passive = torch.zeros(columns, dtype=torch.bool)
    scale = a.abs().max().clamp_min(1e-300)
    tolerance = 1e-12 * columns * scale * b.abs().max().clamp_min(1e-300)
    for _ in range(iterations):
        gradient = a.T @ (b - a @ x)
        gradient[passive] = -torch.inf
        if passive.all() or gradient.max() <= tolerance:
            break
        passive[int(gradient.argmax())] = True
        while True:
            z = torch.zeros_like(x)
            z[passive] = torch.linalg.lstsq(a[:, passive], b[:, None]).solution[:, 0]
            if (z[passive] > 0).all():
                x = z
                break
            shrinking = passive & (z <= 0)
            alpha = (x[shrinking] / (x[shrinking] - z[shrinking])).min()
            x = x + alpha * (z - x)
            passive &= x > 1e-15 * x.abs().max().clamp_min(1e-300)
            x[~passive] = 0
            if not passive.any():
                break
    return x


def _on(device: str, value: Any) -> Any:
    """`value` (a call's arguments: tensors, tuples, dicts) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(_on(device, item) for item in value)
    if isinstance(value, dict):
        return {key: _on(device, item) for key, item in value.items()}
    return value


def _timed(fn: Callable[[], Any], device: str) -> float:
    if device == "cpu":
        return _best(fn)
    sync = getattr(torch, torch.device(device).type).synchronize
    return _best(lambda: (fn(), sync()))


def calibrate(quick: bool, device: str = "cpu") -> tuple[dict[str, rh_policy.Constants], dict[str, dict[str, float]]]:
    """Time each path of each kernel over the grid on `device` (float32), fit the constants, print them and each
    fit's worst relative error; return both (kernel key -> Constants, kernel key -> path -> worst error)."""
    fitted, errors = {}, {}
    for name, make in CALLS.items():
        rows: dict[str, list[tuple[list[float], float]]] = {"kernel": [], "loop": [], "states": []}
        for batch, heads, dim, chunk in (QUICK_GRID if quick else GRID)[name]:
            for path, lengths in (QUICK_LENGTHS if quick else LENGTHS).items():
                for seq in lengths:
                    kernel, original, args, kwargs = make(batch, seq, heads, dim, chunk)
                    args, kwargs = _on(device, args), _on(device, kwargs)
                    shape = kernel.segments.shape(kernel.bind(args, kwargs))
                    if path == "kernel" and batch * seq * heads * shape.key_dim * shape.value_dim > KERNEL_ELEMENTS:
                        continue
                    if path == "states" and 4 * batch * seq * heads * shape.key_dim * shape.value_dim > STATES_BYTES:
                        continue
                    if path == "kernel":

                        def fn():
                            return original(*args, **kwargs)
                    elif path == "loop":

                        def fn():
                            return kernel.loop(*args, on_token=lambda t, s: s, **kwargs)
                    else:

                        def fn():
                            return kernel.segments.all_states(*args, **kwargs)

                    fn()  # warm-up
                    seconds = _timed(fn, device)
                    rows[path].append((TERMS[path](shape, seq), seconds))
                    print(
                        f"  {name:10} {path:6} batch {batch:3} heads {heads:2} dims {shape.key_dim}x{shape.value_dim}"
                        f" chunk {chunk:3} T {seq:4}: {seconds * 1e3:8.2f} ms",
                        flush=True,
                    )
        coefficients, errors[name] = {}, {}
        for path, data in rows.items():
            terms = torch.tensor([t for t, _ in data], dtype=torch.float64)
            times = torch.tensor([s for _, s in data], dtype=torch.float64)
            solution = nnls(terms / times[:, None], torch.ones(len(times), dtype=torch.float64))
            coefficients[path] = solution.tolist()
            worst = max(abs(float(t @ solution) / float(s) - 1) for t, s in zip(terms, times))
            errors[name][path] = worst
            print(f"  {name} {path}: fit {', '.join(f'{c:.2e}' for c in solution)}; worst relative error {worst:.0%}")
        fitted[name] = rh_policy.Constants(**{path: tuple(float(c) for c in coefficients[path]) for path in TERMS})
    for name, c in fitted.items():
        fields = ", ".join(f"{path}=({', '.join(f'{x:.2g}' for x in getattr(c, path))})" for path in TERMS)
        print(f"    {name!r}: Constants({fields}),")
    return fitted, errors


def write(
    key: str,
    fitted: dict[str, rh_policy.Constants],
    errors: dict[str, dict[str, float]],
    file: pathlib.Path = rh_costs.COSTS_FILE,
) -> None:
    """Write one calibration into the costs file under `key` ("cpu/float32"), keeping the others and each kernel's
    "about" line."""
    data = json.loads(file.read_text()) if file.exists() else {}
    old = data.get(key, {}).get("kernels", {})
    worst = [e for per_kernel in errors.values() for e in per_kernel.values()]
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%d %B %Y %H:%M")
    data[key] = {
        "measured": (
            f"python benchmarks/paths.py --calibrate --write (non-negative least squares on relative error,"
            f" each path timed over its grid of shapes, best of 5; float32, no gradients,"
            f" {torch.get_num_threads()} thread(s)), {when} UTC, torch {torch.__version__.split('+')[0]}"
        ),
        "worst relative error": (
            f"{min(worst):.0%}-{max(worst):.0%} over the fits (each path's worst on its own"
            " timings): the model ranks paths that differ by more than that"
        ),
        "kernels": {
            name: {
                **({"about": old[name]["about"]} if "about" in old.get(name, {}) else {}),
                **{path: [float(f"{x:.2g}") for x in getattr(c, path)] for path in TERMS},
                "worst relative error": {path: round(errors[name][path], 2) for path in TERMS},
            }
            for name, c in fitted.items()
        },
    }
    file.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {key} into {file}")


# -- the rows -----------------------------------------------------------------------------------------------------


def _gdn(hidden: int, key_heads: int, value_heads: int, head_dim: int) -> Any:
    import transformers

    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        layer_types=["linear_attention"] * 2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
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


def _mamba2(hidden: int, heads: int, head_dim: int, state: int, chunk: int) -> Any:
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
        num_hidden_layers=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return transformers.Mamba2ForCausalLM(config)


MODELS = {
    "gdn_tiny": ("gated DeltaNet, hidden 64, 4 value heads of 16", lambda: _gdn(64, 2, 4, 16)),
    "gdn_small": ("gated DeltaNet, hidden 256, 8 value heads of 64", lambda: _gdn(256, 4, 8, 64)),
    "mamba2_tiny": ("Mamba-2, hidden 64, 4 heads of 32, state 16, chunk 16", lambda: _mamba2(64, 4, 32, 16, 16)),
    "mamba2": (
        "Mamba-2, mamba2-130m dims: hidden 768, 24 heads of 64, state 128, chunk 256",
        lambda: _mamba2(768, 24, 64, 128, 256),
    ),
}


def spread(count: int, tokens: int) -> list[int]:
    """`count` positions spread over the tokens (the middle of each of `count` equal parts)."""
    return sorted({min(tokens - 1, int((i + 0.5) * tokens / count)) for i in range(count)})


# (model, batch, T, positions kept: a number spread over the tokens, or "all")
ROWS = [
    ("gdn_tiny", 64, 25, 1),
    ("gdn_tiny", 64, 25, 12),
    ("gdn_tiny", 64, 25, "all"),
    ("gdn_tiny", 1, 512, 8),
    ("gdn_small", 64, 25, 1),
    ("gdn_small", 64, 25, 12),
    ("gdn_small", 1, 512, 8),
    ("gdn_small", 1, 512, 64),
    ("mamba2_tiny", 64, 25, 1),
    ("mamba2_tiny", 64, 25, 12),
    ("mamba2_tiny", 1, 512, 8),
    ("mamba2", 1, 512, 8),
    ("mamba2", 1, 1024, 8),
    ("mamba2", 1, 2048, 8),
    ("mamba2", 8, 64, 4),
]
QUICK_ROWS = [("gdn_tiny", 4, 25, 1), ("gdn_tiny", 4, 25, 12), ("gdn_tiny", 4, 25, "all"), ("mamba2_tiny", 4, 40, 3)]

UNHOOKED = ("unhooked", None, True)  # the forward without a watch: what the ratios divide by
VARIANTS = [
    ("segments", rh_policy.Strategy.SEGMENTS, True),
    ("segments, whole", rh_policy.Strategy.SEGMENTS, False),
    ("chunk-wise states", rh_policy.Strategy.STATES, True),
    ("token loop", rh_policy.Strategy.LOOP, True),
]


def _forward(model: Any, ids: torch.Tensor, keep: Any, policy: rh_policy.Paths = rh_policy.DEFAULT) -> None:
    with rh.watch(model, keep={"states": keep}, paths=policy):
        model(ids, use_cache=False)


def _taken(model: Any, ids: torch.Tensor, keep: Any, policy: rh_policy.Paths) -> set[str]:
    """The paths the calls of one forward take under `policy` (from `choose.choose`)."""
    seen: set[str] = set()
    real = rh_choose.choose

    def spy(*args: Any, **kwargs: Any) -> Any:
        choice = real(*args, **kwargs)
        seen.add(
            "token loop"
            if choice is None
            else choice.path.label
            if choice.path is not rh_policy.Strategy.SEGMENTS
            else "segments"
            if choice.tails
            else "segments, whole"
        )
        return choice

    rh_choose.choose = spy
    try:
        _forward(model, ids, keep, policy)
    finally:
        rh_choose.choose = real
    return seen


def _policy(force: rh_policy.Strategy | None, tails: bool) -> rh_policy.Paths:
    return rh_policy.LOOP if force is rh_policy.Strategy.LOOP else rh_policy.Paths(force=force, tails=tails)


def run_row(model: Any, batch: int, tokens: int, count: Any, repeats: int) -> tuple[dict[str, float | None], str]:
    """Each variant's median time (None: the call cannot take it) and the path chosen."""
    ids = torch.randint(3, VOCAB, (batch, tokens), generator=torch.Generator().manual_seed(0))
    keep = list(range(tokens)) if count == "all" else spread(count, tokens)
    runnable = []
    for name, force, tails in VARIANTS:
        taken = _taken(model, ids, keep, _policy(force, tails))
        # a forced path that the call cannot take (forced segments whose pieces are all token loops take the loop)
        wanted = {"segments": {"segments", "segments, whole"}, "segments, whole": {"segments", "segments, whole"}}.get(
            name, {name}
        )
        if taken <= wanted:
            runnable.append((name, force, tails))
    chosen = _taken(model, ids, keep, rh_policy.DEFAULT)
    times: dict[str, list[float]] = {name: [] for name, _, _ in [UNHOOKED, *runnable]}
    for _ in range(repeats + 1):  # the first round warms up
        start = time.perf_counter()
        model(ids, use_cache=False)
        times[UNHOOKED[0]].append(time.perf_counter() - start)
        for name, force, tails in runnable:
            policy = _policy(force, tails)
            start = time.perf_counter()
            _forward(model, ids, keep, policy)
            times[name].append(time.perf_counter() - start)
    medians = {
        name: statistics.median(times[name][1:]) if name in times else None for name, _, _ in [UNHOOKED, *VARIANTS]
    }
    return medians, " + ".join(sorted(chosen))


def rows(quick: bool, repeats: int) -> int:
    """Print the rows; return the number of rows whose chosen path is more than 10% slower than the fastest."""
    built: dict[str, Any] = {}
    header = f"{'model':12} {'batch':>5} {'T':>5} {'kept':>5} | " + " ".join(
        f"{n:>15}" for n, _, _ in [UNHOOKED, *VARIANTS]
    )
    print("ms per forward (median of rounds); chosen path; chosen / fastest path; chosen / unhooked")
    print(header + " | chosen")
    misses = 0
    for key, batch, tokens, count in QUICK_ROWS if quick else ROWS:
        if key not in built:
            torch.manual_seed(0)
            built[key] = MODELS[key][1]().eval()
        with torch.no_grad():
            medians, chosen = run_row(built[key], batch, tokens, count, repeats)
        unhooked = medians.pop(UNHOOKED[0])
        fastest = min(t for t in medians.values() if t is not None)
        picked = [medians[name] for name in chosen.split(" + ") if medians.get(name) is not None]
        ratio = max(picked) / fastest if picked else float("nan")
        misses += not ratio <= 1.1
        cells = " ".join(f"{'-':>15}" if t is None else f"{t * 1e3:15.1f}" for t in [unhooked, *medians.values()])
        print(
            f"{key:12} {batch:5} {tokens:5} {count!s:>5} | {cells} | {chosen} {ratio:.2f}"
            f" {max(picked) / unhooked if picked else float('nan'):.2f}" + ("" if ratio <= 1.1 else "  MISS (> 1.1)"),
            flush=True,
        )
    return misses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one round: a smoke run")
    parser.add_argument("--calibrate", action="store_true", help="time the kernels, fit and print the constants")
    parser.add_argument(
        "--write", action="store_true", help="with --calibrate: write the constants into the package's costs.json"
    )
    parser.add_argument("--device", default="cpu", help="with --calibrate: the device to time on (default cpu)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per row (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the constants' setting)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with torch.no_grad():
            if args.calibrate:
                fitted, errors = calibrate(args.quick, args.device)
                if args.write:
                    write(rh_costs.calibration_key(args.device, torch.float32), fitted, errors)
                return 0
        misses = rows(args.quick, 1 if args.quick else args.repeats)
        print(f"rows where the chosen path is more than 10% slower than the fastest: {misses}")
        return 0
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    sys.exit(main())
