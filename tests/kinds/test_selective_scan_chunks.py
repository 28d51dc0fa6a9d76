"""Mamba-1's chunk-wise selective scan, and Mamba-1 prompts run in segments with it.

Kernel level: `mamba_selective_scan_chunks` (a piece from a state) and `mamba_selective_scan_states` (every
state too) equal the float64 recurrence of `_reference_ssm`, transformers' own `mamba_selective_scan` (the
pure-torch function behind each family's module attribute, `torch_kernel`) from zeros, and the library's token loop from
a state; chunk boundaries anywhere (T not a multiple of the chunk, T = 1), state elements that decay too fast for the
chunk-wise form (stepped on their own), steps of either sign, and bf16/fp16 inputs as the mixers pass them.
Model level: sparse hooks, writes and kept states, and every state kept, on the tiny Mamba-1 models, run
in segments by the chunk-wise scan (a spy checks that transformers' kernel, which cannot start from a state,
runs no piece) and equal the token loop: logits, kept states, hook inputs, cache contents, generate.
"""

import dataclasses

import pytest
import torch
from _compare import assert_close
from _models import PAD, build, random_ids
from _reference_ssm import selective_scan_reference
from _upstream import transformers_kernel
from einops import rearrange

import recurrent_hooks as rh
import recurrent_hooks.engine.paths.runners as rh_busy
from recurrent_hooks.kinds import selective_scan as s6

MAMBA1_FAMILIES = [name for name, row in rh.FAMILIES.items() if issubclass(row.kind, rh.SelectiveScan)]
# float32 against float64: the chunk-wise form divides by the running decay P_j and multiplies by P_i, so a
# term's rounding is about eps * |c| (c the log decay over the chunk, up to 60): a few 1e-6 on O(1) values
TOL = dict(rtol=1e-5, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    seq: int
    d_inner: int
    d_state: int
    chunk: int | None  # None: the library's choice
    gated: bool = True  # z, D, delta_bias + softplus (else bare: dt is the step itself)

    def __str__(self) -> str:
        return f"B{self.batch}-T{self.seq}-D{self.d_inner}-N{self.d_state}-c{self.chunk}{'' if self.gated else '-bare'}"


CASES = [
    Case(2, 37, 6, 4, 8),
    Case(1, 1, 5, 3, 16),
    Case(3, 64, 8, 16, 16),
    Case(2, 100, 4, 4, None),
    Case(2, 29, 6, 4, 64, gated=False),
    Case(1, 17, 3, 2, 1),
]


def inputs(case: Case, seed: int = 0) -> dict:
    """`mamba_selective_scan` arguments (channel-major), as the Mamba-1 mixers pass them."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    b, d, n, t = case.batch, case.d_inner, case.d_state, case.seq
    return dict(
        hidden_states=r(b, d, t),
        dt=r(b, d, t) * 0.5 - 1.5 if case.gated else torch.rand(b, d, t, generator=gen) * 0.3 + 0.05,
        A=-torch.exp(r(d, n) * 0.5),
        B=r(b, n, t),
        C=r(b, n, t),
        D=r(d) if case.gated else None,
        z=r(b, d, t) if case.gated else None,
        delta_bias=r(d) * 0.3 if case.gated else None,
        delta_softplus=case.gated,
    )


def reference(x: dict, initial_state=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 recurrence: outputs `[batch, d_inner, seq]`, states `[batch, seq, d_inner, d_state]`."""
    token_major = lambda v: None if v is None else rearrange(v, "b c t -> b t c")  # noqa: E731
    out, states = selective_scan_reference(
        token_major(x["hidden_states"]),
        token_major(x["dt"]),
        x["A"],
        token_major(x["B"]),
        token_major(x["C"]),
        x["D"],
        token_major(x["z"]),
        dt_bias=x["delta_bias"],
        softplus=x["delta_softplus"],
        initial_state=initial_state,
    )
    return rearrange(out, "b t d -> b d t"), states


def loop_states(x: dict, initial_state=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The library's token loop: output, last state and every state `[seq, batch, d_inner, d_state]`."""
    seen = []
    out, last = s6.mamba_selective_scan(
        **x, return_last_state=True, initial_state=initial_state, on_token=lambda t, s: seen.append(s) or s
    )
    return out, last, torch.stack(seen)


def hf_kernel(family: str):
    """transformers' own pure-torch `mamba_selective_scan` of `family` (under the hub wrapper)."""
    return transformers_kernel(family, "mamba_selective_scan")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_chunks_from_zeros_equal_the_float64_reference(case):
    x = inputs(case)
    ref_out, ref_states = reference(x)
    out, last = s6.mamba_selective_scan_chunks(**x, return_last_state=True, chunk=case.chunk)
    assert_close("output", ref_out, out, **TOL)
    assert_close("last state", ref_states[:, -1], last, **TOL)
    (states_out, states_last), every = s6.mamba_selective_scan_states(**x, return_last_state=True, chunk=case.chunk)
    assert_close("every state", ref_states, every.movedim(0, 1), **TOL)
    assert_close("all-states output == output", out, states_out, rtol=0, atol=0)
    assert_close("all-states last state == every[-1]", every[-1], states_last, rtol=0, atol=0)


@pytest.mark.parametrize("family", MAMBA1_FAMILIES)
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[4]], ids=str)
def test_chunks_equal_transformers(family, case):
    """From zeros, what transformers' own kernel computes (it cannot start anywhere else)."""
    x = inputs(case)
    ref_out, ref_last = hf_kernel(family)(**x, return_last_state=True)
    out, last = s6.mamba_selective_scan_chunks(**x, return_last_state=True, chunk=case.chunk)
    assert_close("output", ref_out, out, **TOL)
    assert_close("last state", ref_last, last, **TOL)
    assert_close(
        "output without return_last_state",
        hf_kernel(family)(**x),
        s6.mamba_selective_scan_chunks(**x, chunk=case.chunk),
        **TOL,
    )


@pytest.mark.parametrize("case", CASES, ids=str)
def test_chunks_from_a_state_equal_the_token_loop(case):
    x = inputs(case)
    h0 = torch.randn(case.batch, case.d_inner, case.d_state, generator=torch.Generator().manual_seed(1))
    loop_out, loop_last, loop_every = loop_states(x, h0)
    out, last = s6.mamba_selective_scan_chunks(**x, return_last_state=True, initial_state=h0, chunk=case.chunk)
    assert_close("output", loop_out, out, **TOL)
    assert_close("last state", loop_last, last, **TOL)
    (_, _), every = s6.mamba_selective_scan_states(**x, return_last_state=True, initial_state=h0, chunk=case.chunk)
    assert_close("every state", loop_every, every, **TOL)
    assert_close("from a state, float64", reference(x, h0)[1], every.movedim(0, 1), **TOL)
    assert torch.equal(
        h0, torch.randn(case.batch, case.d_inner, case.d_state, generator=torch.Generator().manual_seed(1))
    ), "the initial state was written"


def test_pieces_chain_like_one_call():
    """Pieces of any length, each from the state the previous one returned, give the whole call."""
    x = inputs(Case(2, 50, 6, 4, 16))
    whole, whole_last = s6.mamba_selective_scan_chunks(**x, return_last_state=True)
    per_token = ("hidden_states", "dt", "B", "C", "z")
    outs, state = [], None
    for start, stop in [(0, 1), (1, 18), (18, 19), (19, 50)]:
        piece = {k: v[..., start:stop] if k in per_token else v for k, v in x.items()}
        out, state = s6.mamba_selective_scan_chunks(**piece, return_last_state=True, initial_state=state)
        outs.append(out)
    assert_close("pieces == one call", whole, torch.cat(outs, dim=-1), **TOL)
    assert_close("last state", whole_last, state, **TOL)


@pytest.mark.parametrize("shift", [4.0, 30.0], ids=["fast", "memoryless"])
def test_fast_decaying_elements_step_through(shift):
    """Steps of ~4 (fast) or ~30 (one token decays by e^-30 or more): 1 / P would overflow float32 over a
    64-token chunk, so those state elements are stepped token by token; every value stays finite."""
    case = Case(2, 40, 6, 4, 64)
    x = inputs(case)
    x["dt"] = x["dt"] + shift
    ref_out, ref_states = reference(x)
    (out, _), every = s6.mamba_selective_scan_states(**x, return_last_state=True, chunk=64)
    assert torch.isfinite(every).all() and torch.isfinite(out).all()
    assert_close("output", ref_out, out, **TOL)
    assert_close("every state", ref_states, every.movedim(0, 1), **TOL)


def test_steps_of_either_sign():
    """Without softplus a step may be negative (a decay above 1): the range check bounds |c| both ways."""
    case = Case(2, 24, 6, 4, 16, gated=False)
    x = inputs(case)
    x["dt"] = torch.rand(x["dt"].shape, generator=torch.Generator().manual_seed(2)) * 0.6 - 0.3
    ref_out, ref_states = reference(x)
    (out, _), every = s6.mamba_selective_scan_states(**x, return_last_state=True)
    assert_close("output", ref_out, out, **TOL)
    assert_close("every state", ref_states, every.movedim(0, 1), **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_inputs(dtype):
    """Half inputs as the mixers pass them (A, D and the dt bias float32): float32 result and state, as
    transformers' kernel and the token loop. Both scans run in float32 from the same half inputs, but C . h
    is read in the half dtype (as transformers does): a state that differs by float32 rounding can round to a
    neighbouring half value, one half ulp (bf16 2^-8 relative, fp16 2^-11) of a product of size ~1."""
    case = Case(2, 37, 6, 4, 8)
    x = {
        k: (v.to(dtype) if isinstance(v, torch.Tensor) and k not in ("A", "D", "delta_bias") else v)
        for k, v in inputs(case).items()
    }
    loose = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=3e-3, atol=3e-3)
    loop_out, _, loop_every = loop_states(x)
    (out, last), every = s6.mamba_selective_scan_states(**x, return_last_state=True, chunk=case.chunk)
    ref_out, ref_last = hf_kernel("mamba")(**x, return_last_state=True)
    assert out.dtype == loop_out.dtype == ref_out.dtype == torch.float32
    assert last.dtype == every.dtype == torch.float32
    assert_close("states against the loop (float32 from the same inputs)", loop_every, every, **TOL)
    assert_close("last state against transformers", ref_last, last, **TOL)
    assert_close("output against the loop", loop_out, out, **loose)
    assert_close("output against transformers", ref_out, out, **loose)


def test_the_prompt_kernel_row_declares_the_library_pieces():
    segments = rh.SelectiveScan.kernel_for("prompt").segments
    assert segments.kernel is s6.mamba_selective_scan_piece
    assert segments.all_states is s6.mamba_selective_scan_piece_states
    assert rh.PerHeadSelectiveScan.kernel_for("prompt").segments is segments


@pytest.mark.parametrize("d_inner", [8, 1024], ids=["chunk-wise", "token-loop"])
def test_pieces_choose_by_size_and_agree(d_inner, monkeypatch):
    """Small states run chunk-wise, large ones (above CHUNKWISE_UP_TO elements) the token loop: same results."""
    case = Case(1, 21, d_inner, 16, None)
    x = inputs(case)
    h0 = torch.randn(1, d_inner, 16, generator=torch.Generator().manual_seed(3))
    ran = []
    for name in ("mamba_selective_scan_chunks", "mamba_selective_scan_states", "mamba_selective_scan"):
        real = getattr(s6, name)
        monkeypatch.setattr(s6, name, lambda *a, _real=real, _name=name, **k: ran.append(_name) or _real(*a, **k))
    with torch.no_grad():
        out, last = s6.mamba_selective_scan_piece(**x, return_last_state=True, initial_state=h0)
        (states_out, _), every = s6.mamba_selective_scan_piece_states(**x, return_last_state=True, initial_state=h0)
    chunk_wise = 16 * d_inner <= s6.CHUNKWISE_UP_TO
    assert ran == (
        ["mamba_selective_scan_chunks", "mamba_selective_scan_states"]
        if chunk_wise
        else ["mamba_selective_scan", "mamba_selective_scan"]
    )
    ran.clear()
    with torch.enable_grad():  # the chunk-wise scan writes its buffers in place: the token loop runs the piece
        assert_close("with gradients on", out, s6.mamba_selective_scan_piece(**x, initial_state=h0), **TOL)
    assert ran == ["mamba_selective_scan"]
    ref_out, ref_states = reference(x, h0)
    assert_close("output", ref_out, out, **TOL)
    assert_close("last state", ref_states[:, -1], last, **TOL)
    assert_close("every state", ref_states, every.movedim(0, 1), **TOL)
    assert_close("all-states output", out, states_out, **TOL)


# -- the watched models ---------------------------------------------------------------------------------


T = 23
ALL = ("states", "windows", "inputs", "outputs")


def _spy(monkeypatch) -> list:
    """Record each `runners.run_in_segments` call (whether it keeps every state) and each chunk-wise scan (its name),
    and hand `run_in_segments` an `original` that fails: transformers' kernel cannot start from a state, so
    the library's must run every piece."""
    runs = []
    real = rh_busy.run_in_segments

    def refuse(*args, **kwargs):
        raise AssertionError("transformers' mamba_selective_scan ran a piece")

    def spy(kernel, original, *rest):
        runs.append(bool(rest[-1]))
        return real(kernel, refuse, *rest)

    monkeypatch.setattr(rh_busy, "run_in_segments", spy)
    for name in ("mamba_selective_scan_chunks", "mamba_selective_scan_states"):  # the tiny models' states are small
        real_scan = getattr(s6, name)
        monkeypatch.setattr(s6, name, lambda *a, _real=real_scan, _name=name, **k: runs.append(_name) or _real(*a, **k))
    return runs


def _sparse(model, ids, fast, monkeypatch):
    """Kept states, writes and hooks at a few prompt tokens, a write at a decode step, through generate."""
    paths = None if fast else rh.Paths(rule="loop")
    runs = _spy(monkeypatch)
    seen = []
    keep = {"states": [0, 5, 11, -1], "windows": [5], "inputs": None}
    with rh.watch(model, keep=keep, paths=paths) as w, torch.no_grad():
        model(ids)
        value = w.mixers[0].state_after(5) * 0.5
    with rh.watch(model, keep=keep, paths=paths) as w, torch.no_grad():
        w.mixers[0].set_state_after(5, value)
        w.mixers[-1].register_state_hook(lambda m, c, t, s: seen.append(s.clone()) or s * 0.9, token=[2, 12, -3])
        w.mixers[0].set_state_after(0, value, call=1)
        out = model.generate(
            ids, max_new_tokens=3, do_sample=False, pad_token_id=PAD, output_logits=True, return_dict_in_generate=True
        )
    return w, out, seen, runs


@pytest.mark.parametrize("family", MAMBA1_FAMILIES)
def test_sparse_calls_in_segments_equal_the_token_loop(family, monkeypatch):
    model, ids = build(family), random_ids(2, T)
    fast, fast_out, fast_seen, runs = _sparse(model, ids, True, monkeypatch)
    slow, slow_out, slow_seen, slow_runs = _sparse(model, ids, False, monkeypatch)
    assert False in runs and True not in runs and not slow_runs, "the sparse prompts did not run in segments"
    assert "mamba_selective_scan_chunks" in runs, "the pieces did not run chunk-wise"
    for step, (a, b) in enumerate(zip(slow_out.logits, fast_out.logits)):
        assert_close(f"logits of call {step}", a, b, rtol=1e-4, atol=1e-5)
    assert_close("sequences", slow_out.sequences, fast_out.sequences, rtol=0, atol=0)
    assert len(fast_seen) == len(slow_seen) > 0
    assert_close("hook inputs", torch.stack(slow_seen), torch.stack(fast_seen), rtol=1e-4, atol=1e-6)
    for a, b in zip(slow.mixers, fast.mixers):
        for token in (0, 5, 11, -1):
            assert_close(
                f"{a} state after {token}", a.state_after(token, 0), b.state_after(token, 0), rtol=1e-4, atol=1e-6
            )
        assert len(a.calls) == len(b.calls) == 3  # the prompt and two decode steps
        for call in (1, 2):  # the decode steps: what the cache handed over, and the state they left
            assert_close(
                f"{a} call {call} state in",
                a.calls[call].kernel_calls[0].inputs["state"],
                b.calls[call].kernel_calls[0].inputs["state"],
                rtol=1e-4,
                atol=1e-6,
            )
            assert_close(
                f"{a} call {call} state after", a.state_after(0, call), b.state_after(0, call), rtol=1e-4, atol=1e-6
            )
        assert_close(
            f"{a} cached state",
            slow_out.past_key_values.get_recurrent_state(a.layer),
            fast_out.past_key_values.get_recurrent_state(b.layer),
            rtol=1e-4,
            atol=1e-6,
        )


@pytest.mark.parametrize("family", MAMBA1_FAMILIES)
def test_every_state_kept_chunk_wise_equals_the_token_loop(family, monkeypatch):
    """keep=ALL without gradients: the all-states scan, in segments around a hook that writes."""
    model, ids = build(family), random_ids(2, 70)
    runs, results = [], {}
    for fast in (True, False):
        runs = _spy(monkeypatch)
        seen = []
        with rh.watch(model, keep=ALL, paths=None if fast else rh.Paths(rule="loop")) as w, torch.no_grad():
            w.mixers[0].register_state_hook(lambda m, c, t, s: seen.append(s.clone()) or s * 0.5, token=40)
            out = model(ids, use_cache=True)
        results[fast] = (w, out, seen, runs)
    (fast, fast_out, fast_seen, runs), (slow, slow_out, slow_seen, slow_runs) = results[True], results[False]
    assert True in runs and False not in runs and not slow_runs, "the prompts did not run the all-states scan"
    assert "mamba_selective_scan_states" in runs, "the pieces did not run chunk-wise"
    assert_close("logits", slow_out.logits, fast_out.logits, rtol=1e-4, atol=1e-5)
    assert_close("hook input", torch.stack(slow_seen), torch.stack(fast_seen), rtol=1e-4, atol=1e-6)
    for a, b in zip(slow.mixers, fast.mixers):
        assert_close(f"{a} every state", a.states, b.states, rtol=1e-4, atol=1e-6)
        # zamba: per head
        for head, (pa, pb) in enumerate(zip(a.calls[0].kernel_calls, b.calls[0].kernel_calls, strict=True)):
            assert_close(f"{a} kernel output {head}", pa.output["output"], pb.output["output"], rtol=1e-4, atol=1e-5)
        assert_close(
            f"{a} cached state",
            slow_out.past_key_values.get_recurrent_state(a.layer),
            fast_out.past_key_values.get_recurrent_state(b.layer),
            rtol=1e-4,
            atol=1e-6,
        )
