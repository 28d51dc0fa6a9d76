"""bf16 and fp16: the library's token loops agree with the unwatched model as closely as transformers' own two paths.

In a half-precision model, transformers computes its recurrences partly in the model dtype (Mamba-1
reads C_t . h_t in it, Mamba-2's decode kernel forms Δ B x and h C in it) and partly in float32 (the
states, the gated delta rules). Its prompt kernel and its decode kernel therefore disagree by rounding,
and that disagreement is the yardstick here: the unwatched model's logits, against the same model with
its prompt kernel replaced by its own decode kernel run one token at a time (the `_DECODE_LOOPS`
wrappers below, built from the module's own decode kernel, nothing of the library's). The library's
token loops must stay within a small multiple of it, with a hook at every token (the token loop) and
with the fast paths (every state kept chunk-wise, or a few stops in segments), in the prompt and at
decode steps; and the states they hand over stay float32, as in transformers' cache.

The convolution has the same yardstick (the prompt conv kernel replaced by the decode conv kernel run
token by token), and transformers' two conv paths agree bit for bit: with conv windows kept, hooked
or written back, the logits, and the windows kept and cached, are the unwatched model's, bit for bit,
in bf16, fp16 and float32; and the conv loops equal transformers' conv kernels bit for bit, also
when a window is replaced.
"""

import contextlib

import pytest
import torch
import transformers
from _compare import assert_close
from _models import PAD, build, random_ids
from _upstream import transformers_kernel

import recurrent_hooks as rh
from recurrent_hooks.demo import tiny_model
from recurrent_hooks.kinds.shared.conv import CONV_KERNELS, causal_conv1d_fn, causal_conv1d_update
from recurrent_hooks.registry import FAMILIES as REGISTERED
from recurrent_hooks.registry import family_of

# one family per kernel layout: gated DeltaNet, KDA, Mamba-1 (three modules), Mamba-1 per head, Mamba-2 (+ a hybrid)
FAMILIES = ["qwen3_5", "kimi_linear", "mamba", "falcon_mamba", "jamba", "zamba", "mamba2", "bamba"]
DTYPES = [torch.bfloat16, torch.float16]
BATCH, T, NEW = 2, 13, 3

# The library may differ from the unwatched model by at most K times transformers' own prompt-vs-decode
# difference (max |logits| difference, per family, dtype and run: prompt or generate). The loops now run
# transformers' ops in transformers' dtypes, so what is left is float32 summation order (a token loop or
# the chunk-wise fast path standing in for a chunked prompt kernel): the same kind of difference as the
# yardstick. Half-precision logits move in whole ulps, and one flipped rounding of a large logit is
# already about one yardstick, so K = 4 allows a few such flips. It is a bound on drift, not a test of
# the dtypes (a loop reading C.h in float32 stays within about 1x): `test_loops_round_as_transformers_kernels`
# checks those bit for bit. FLOOR (below half an ulp of these logits in either dtype) makes the bound
# "bit-identical" where transformers' own two paths agree exactly (yardstick 0).
K = 4.0
FLOOR = 1e-5


def _kernel_module(model):
    """The modeling module whose globals the family's mixers read their kernels from."""
    (family,) = {f for f in (family_of(m) for m in model.modules()) if f is not None}
    return family.module(), family.kind


def _gated_delta_by_decode(decode):
    def prompt(
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        state, outputs = initial_state, []
        for t in range(value.shape[1]):
            one = lambda x: x[:, t : t + 1]  # noqa: E731
            out, state = decode(
                one(query),
                one(key),
                one(value),
                g=one(g),
                beta=one(beta),
                initial_state=state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )
            outputs.append(out)
        return torch.cat(outputs, dim=1), (state if output_final_state else None)

    return prompt


def _selective_scan_by_decode(decode):
    def prompt(
        hidden_states,
        dt,
        A,
        B,
        C,
        D=None,
        z=None,
        delta_bias=None,
        delta_softplus=False,
        return_last_state=False,
        **kwargs,
    ):
        batch, d_inner, seq = hidden_states.shape
        state = torch.zeros(batch, d_inner, A.shape[-1], dtype=torch.float32)  # the cache's dtype
        # the mixers hand the decode kernel D in the model dtype (the prompt kernel gets D.float())
        D = None if D is None else D.to(hidden_states.dtype)
        outputs = [
            decode(
                state,
                hidden_states[..., t],
                dt[..., t],
                A,
                B[..., t],
                C[..., t],
                D,
                dt_bias=delta_bias,
                dt_softplus=delta_softplus,
                z=None if z is None else z[..., t],
            )
            for t in range(seq)
        ]
        y = torch.stack(outputs, dim=-1)
        return (y, state) if return_last_state else y

    return prompt


def _ssd_by_decode(decode):
    def prompt(
        hidden_states,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        dt_bias=None,
        initial_states=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
        **kwargs,
    ):
        batch, seq, heads, head_dim = hidden_states.shape
        d_state = B.shape[-1]
        state = (
            torch.zeros(batch, heads, head_dim, d_state)
            if initial_states is None
            else initial_states.to(torch.float32, copy=True)
        )
        per_channel = lambda v: v[..., None].expand(*v.shape, head_dim)  # noqa: E731  as the mixers expand them
        A_d = A[:, None, None].expand(heads, head_dim, d_state)
        outputs = [
            decode(
                state,
                hidden_states[:, t],
                per_channel(dt[:, t]),
                A_d,
                B[:, t],
                C[:, t],
                None if D is None else per_channel(D),
                dt_bias=None if dt_bias is None else per_channel(dt_bias),
                dt_softplus=dt_softplus,
                z=None,
            )
            for t in range(seq)
        ]
        y = torch.stack(outputs, dim=1)
        return (y, state) if return_final_states else y

    return prompt


_DECODE_LOOPS = {
    rh.GatedDeltaNet: _gated_delta_by_decode,
    rh.KimiDeltaAttention: _gated_delta_by_decode,
    rh.SelectiveScan: _selective_scan_by_decode,
    rh.PerHeadSelectiveScan: _selective_scan_by_decode,
    rh.Mamba2StateSpace: _ssd_by_decode,
}


CASES = {family: (lambda family=family: build(family)) for family in FAMILIES}
CASES["qwen3_5 (demo)"] = tiny_model  # wider than tests/_models' qwen3_5: its fp16 rounding shows in the logits


class _Forced(transformers.LogitsProcessor):
    """Generate these tokens whatever the logits say, so that every path decodes the same sequence."""

    def __init__(self, tokens):
        self.tokens = tokens

    def __call__(self, input_ids, scores):
        step = self.tokens[:, input_ids.shape[1] - T, None]
        return torch.full_like(scores, -torch.inf).scatter_(1, step, 0.0)


def _prompt(model, ids):
    return model(ids, use_cache=False).logits.float()


def _generate(model, ids):
    """Logits of the prompt's last token and of NEW - 1 decode steps over the cache, and the cache."""
    out = model.generate(
        ids[:, :T],
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=PAD,
        output_logits=True,
        return_dict_in_generate=True,
        logits_processor=[_Forced(ids[:, T:])],
    )
    return torch.stack(out.logits, dim=1).float(), out.past_key_values


@contextlib.contextmanager
def _by_decode(model):
    """The model's prompt kernel replaced by its own decode kernel run token by token."""
    module, kind = _kernel_module(model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            module, kind.kernel_for("prompt").name, _DECODE_LOOPS[kind](getattr(module, kind.kernel_for("decode").name))
        )
        yield


def _every_token(w):
    for mixer in w.mixers:
        mixer.register_state_hook(lambda m, c, t, s: None)  # a hook at every token: the token loop


FIXED = rh.Paths(rule="fixed")  # the fast paths `measure` names: the cost model takes the token loop at tiny dims


def measure(model, ids):
    """Logits of every path, unwatched and watched (name -> logits), and every state the watches kept (the watches
    on the fixed rule)."""
    prompt, generated = ids[:, :T], ids
    logits, states = {}, []
    with torch.no_grad():
        logits["prompt"] = _prompt(model, prompt)
        logits["generate"], _ = _generate(model, generated)
        with _by_decode(model):
            logits["prompt by decode"] = _prompt(model, prompt)
            logits["generate by decode"], _ = _generate(model, generated)
        with rh.watch(model, keep=(), paths=FIXED) as w:
            _every_token(w)
            logits["prompt, token loop"] = _prompt(model, prompt)
            logits["generate, token loop"], cache = _generate(model, generated)
            states += [cache.get_recurrent_state(m.layer) for m in w.mixers]
        with rh.watch(model, keep=("states",), paths=FIXED) as w:
            logits["prompt, every state kept"] = _prompt(model, prompt)  # chunk-wise, where the kind has it
            states += [m.states for m in w.mixers]
            logits["generate, every state kept"], _ = _generate(model, generated)
            states += [m.states for m in w.mixers]  # the last decode step's
        with rh.watch(model, keep={"states": [4, -1]}, paths=FIXED) as w:
            logits["prompt, two states kept"] = _prompt(model, prompt)  # the bound kernel in segments, if it has them
            states += [m.state_after(4) for m in w.mixers]
    return logits, states


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_half_precision_within_transformers_own_prompt_vs_decode_difference(case, dtype):
    model = CASES[case]().to(dtype)
    logits, states = measure(model, random_ids(BATCH, T + NEW))
    for run in ("prompt", "generate"):
        # transformers' own difference between its two paths, in this model and dtype
        yardstick = (logits[f"{run} by decode"] - logits[run]).abs().max().item()
        tolerance = max(K * yardstick, FLOOR)
        for name in logits:
            if name.startswith(f"{run}, "):
                assert_close(
                    f"{case} {dtype} {name} (yardstick {yardstick:.3g})",
                    logits[run],
                    logits[name],
                    rtol=0,
                    atol=tolerance,
                )
    for state in states:
        assert state.dtype == torch.float32, f"{case} {dtype}: a state handed over in {state.dtype}"


def _exact_kernels(kind):
    """The kernels whose library loop runs transformers' own ops in its own order: decode kernels, and
    Mamba-1's prompt kernel (transformers' is a token loop too). The other prompt kernels are chunk-wise
    and are checked through the logits above."""
    exact = {kind.kernel_for("decode").name}
    if issubclass(kind, rh.SelectiveScan):
        exact.add(kind.kernel_for("prompt").name)
    return exact


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_loops_round_as_transformers_kernels(case, dtype):
    """Fed the arguments transformers' kernels got in a generate, the loops give their outputs and states
    bit for bit: the same ops in the same dtypes (a loop that reads C.h or forms Δ B x in float32 fails)."""
    model = CASES[case]().to(dtype)
    _, kind = _kernel_module(model)
    # Mamba-1's float32 loop keeps its own order for Δ x B (transformers: Δ B x), a float32 ulp apart; in bf16
    # and fp16 both round to the same output. Everything else is bit for bit.
    ulp = dtype == torch.float32 and issubclass(kind, rh.SelectiveScan)
    tolerance = dict(rtol=1e-6, atol=1e-7) if ulp else dict(rtol=0, atol=0)
    checked = 0
    with torch.no_grad(), rh.watch(model, keep=("inputs", "outputs")) as w:
        _generate(model, random_ids(BATCH, T + NEW))
    for mixer in w.mixers:
        for call in mixer.calls:
            for part in call.kernel_calls:
                if part.kernel not in _exact_kernels(kind):
                    continue
                kernel = kind.kernel(part.kernel)
                inputs = {
                    name: value.clone() if name == kernel.state_in and value is not None else value
                    for name, value in part.inputs.items()
                }
                got = kernel.name_results(kernel.loop(**inputs))
                if kernel.in_place:
                    got["final_state"] = inputs[kernel.state_in]
                for name, value in part.output.items():
                    if value is not None:
                        assert_close(
                            f"{case} {dtype} {mixer} call {call.index} {part.kernel} {name}",
                            value,
                            got[name],
                            **tolerance,
                        )
                        checked += 1
    assert checked, f"{case}: no kernel call was checked"


# -- the convolution --------------------------------------------------------------------------------------


def _conv_by_decode(module):
    """transformers' prompt conv kernel replaced by its own decode conv kernel, run token by token."""
    decode = module.causal_conv1d_update

    def prompt(hidden_states, weight, bias=None, activation=None, **kwargs):
        window = hidden_states.new_zeros(*hidden_states.shape[:2], weight.shape[-1])
        return torch.cat(
            [
                decode(hidden_states[..., p, None], window, weight, bias, activation)
                for p in range(hidden_states.shape[-1])
            ],
            dim=-1,
        )

    return prompt


def _after_prompt(model, prompt):
    """The cache after the prompt's forward (a generate of one token: no decode step)."""
    return model.generate(
        prompt, max_new_tokens=1, do_sample=False, pad_token_id=PAD, return_dict_in_generate=True
    ).past_key_values


def _conv_windows(model, cache):
    """The conv windows the cache holds, per recurrent mixer."""
    return [cache.get_conv_state(m.layer_idx) for m in model.modules() if family_of(m) is not None]


def _write_back(kept):
    """Write, after a few prompt tokens, the windows a kept run had there (new tensors, the same values)."""

    def arm(w):
        for mixer, windows in zip(w.mixers, kept):
            for token, window in windows.items():
                mixer.set_window_after(token, window.clone())

    return arm


WRITTEN = [0, 3, 4, T - 2, T - 1]  # next to each other too: a written window feeds the next K - 1 tokens


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_conv_windows_kept_hooked_or_written_leave_the_model_bit_identical(case, dtype):
    """Only the convolution watched: its loop makes transformers' own conv calls, so the logits stay
    within K times transformers' own conv prompt-vs-decode difference, which is 0 (bit-identical)."""
    model = CASES[case]().to(dtype)
    module, _ = _kernel_module(model)
    ids = random_ids(BATCH, T + NEW)
    prompt = ids[:, :T]
    logits = {}
    with torch.no_grad():
        logits["prompt"] = _prompt(model, prompt)
        logits["generate"], cache = _generate(model, ids)
        cached = _conv_windows(model, cache)
        cached_after_prompt = _conv_windows(model, _after_prompt(model, prompt))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(module, "causal_conv1d_fn", _conv_by_decode(module))
            logits["prompt by decode"] = _prompt(model, prompt)
            logits["generate by decode"], _ = _generate(model, ids)
        with rh.watch(model, keep=("windows",)) as w:
            logits["prompt, windows kept"] = _prompt(model, prompt)
            prompt_windows = [m.windows for m in w.mixers]  # [batch, T, channels, kernel_size]
            logits["generate, windows kept"], kept_cache = _generate(model, ids)
            last_windows = [m.windows[:, -1] for m in w.mixers]  # the last decode step's
            _after_prompt(model, prompt)
            kept_after_prompt = [m.window_after(T - 1) for m in w.mixers]
        with rh.watch(model, keep=()) as w:
            for mixer in w.mixers:
                mixer.register_state_hook(lambda m, c, t, s: None, memory="window")
            logits["prompt, windows hooked"] = _prompt(model, prompt)
            logits["generate, windows hooked"], _ = _generate(model, ids)
        kept = [{t: windows[:, t] for t in WRITTEN} for windows in prompt_windows]
        with rh.watch(model, keep=()) as w:
            _write_back(kept)(w)
            logits["prompt, windows written back"] = _prompt(model, prompt)
            logits["generate, windows written back"], written_cache = _generate(model, ids)
    for run in ("prompt", "generate"):
        yardstick = (logits[f"{run} by decode"] - logits[run]).abs().max().item()
        for name in logits:
            if name.startswith(f"{run}, "):
                assert_close(
                    f"{case} {dtype} {name} (conv yardstick {yardstick:.3g})",
                    logits[run],
                    logits[name],
                    rtol=0,
                    atol=K * yardstick,
                )
    # the windows handed over are the ones transformers caches, in its dtype
    for what, theirs, ours in [
        ("after the prompt", cached_after_prompt, kept_after_prompt),
        ("after the last step", cached, last_windows),
        ("cached by the watched generate", cached, _conv_windows(model, kept_cache)),
        ("cached after writing back", cached, _conv_windows(model, written_cache)),
    ]:
        for layer, (a, b) in enumerate(zip(theirs, ours)):
            assert b.dtype == a.dtype, f"{case} {dtype} window {what} in {b.dtype}, cached in {a.dtype}"
            assert_close(f"{case} {dtype} mixer {layer} window {what}", a, b, rtol=0, atol=0)


def _hf(family, name):
    return transformers_kernel(family, name)


def _conv_inputs(dtype, length, layout, seed=0, batch=2, channels=40, size=4):
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    if layout == "transposed":  # as the mixers hand it over: a channel slice of a [b, L, 2c] projection, transposed
        x = randn(batch, length, 2 * channels).transpose(1, 2)[:, :channels]
    else:
        x = randn(batch, channels, length)
    return x, randn(channels, size), randn(channels)


CONV_FAMILIES = [
    name
    for name, row in REGISTERED.items()  # the families whose modules call the shared conv kernels
    if {k.name for k in CONV_KERNELS} <= {k.name for k in row.kind.KERNELS}
]


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32], ids=str)
@pytest.mark.parametrize("family", CONV_FAMILIES)
def test_conv_loops_equal_transformers_conv_kernels_bit_for_bit(family, dtype):
    """Every registered module's own conv kernels, with the windows handed to a hook (the token loop),
    over a cached prefix, each layout the mixers pass, with and without bias and activation."""
    fn, update = _hf(family, "causal_conv1d_fn"), _hf(family, "causal_conv1d_update")
    same = lambda t, w: w  # noqa: E731
    for layout in ("contiguous", "transposed"):
        for length in (1, 5, 19):
            x, weight, bias = _conv_inputs(dtype, length, layout, seed=length)
            for b in (bias, None):
                for activation in (None, "silu"):
                    what = f"{family} {dtype} {layout} L{length} bias={b is not None} {activation}"
                    theirs = fn(x, weight, b, activation)
                    for tokens in {length, max(1, length - 3)}:
                        ours = causal_conv1d_fn(x, weight, b, activation, on_token=same, tokens=tokens)
                        assert ours.stride() == theirs.stride(), what
                        assert_close(f"{what} prompt, {tokens} tokens", theirs, ours, rtol=0, atol=0)
                    state = _conv_inputs(dtype, 4, "contiguous", seed=99)[0]
                    theirs_state, ours_state = state.clone(), state.clone()
                    theirs = update(x, theirs_state, weight, b, activation)
                    ours = causal_conv1d_update(x, ours_state, weight, b, activation, on_token=same)
                    assert_close(f"{what} decode", theirs, ours, rtol=0, atol=0)
                    assert_close(f"{what} decode window", theirs_state, ours_state, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32], ids=str)
@pytest.mark.parametrize("family", ["qwen3_5", "mamba", "mamba2"])
def test_a_written_window_gives_transformers_continuation_bit_for_bit(family, dtype):
    """A window written after token t (replaced, or changed in place) is what transformers' prompt kernel
    continues from over a cache: tokens t+1.. give its outputs bit for bit, tokens up to t their own."""
    fn, update = _hf(family, "causal_conv1d_fn"), _hf(family, "causal_conv1d_update")
    x, weight, bias = _conv_inputs(dtype, 12, "transposed")
    written = _conv_inputs(dtype, 4, "contiguous", seed=7)[0]
    plain = fn(x, weight, bias)
    for t in (0, 4, 10):

        def replace(token, window):
            return written if token == t else window

        def in_place(token, window):
            return window.copy_(written) if token == t else window

        for how, hook in (("replaced", replace), ("changed in place", in_place)):
            ours = causal_conv1d_fn(x, weight, bias, on_token=hook)
            # transformers over a cache: the cached window prepended, its outputs the last ones
            continued = fn(torch.cat([written, x[..., t + 1 :]], dim=-1), weight, bias)[..., 4:]
            assert_close(
                f"{family} {dtype} write after {t} ({how}): before",
                plain[..., : t + 1],
                ours[..., : t + 1],
                rtol=0,
                atol=0,
            )
            assert_close(
                f"{family} {dtype} write after {t} ({how}): after", continued, ours[..., t + 1 :], rtol=0, atol=0
            )
    # decode: the written window is what the cache keeps and the next step reads
    state = written.clone()
    ours_state = torch.zeros_like(state)
    causal_conv1d_update(x[..., :1], ours_state, weight, bias, "silu", on_token=lambda t, w: written)
    assert_close(f"{family} {dtype} decode write", written, ours_state, rtol=0, atol=0)
    assert_close(
        f"{family} {dtype} decode after a write",
        update(x[..., 1:2], state, weight, bias, "silu"),
        causal_conv1d_update(x[..., 1:2], ours_state, weight, bias, "silu", on_token=lambda t, w: w),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_conv_loops_round_as_transformers_conv_kernels_on_a_generate(case, dtype):
    """Fed the conv arguments transformers' kernels got in a generate, the loops give their outputs and
    windows bit for bit, handing the windows over unchanged or as new tensors at every token (which
    recomputes every position from its window)."""
    model = CASES[case]().to(dtype)
    _, kind = _kernel_module(model)
    with torch.no_grad(), rh.watch(model, keep=("inputs", "outputs")) as w:
        _generate(model, random_ids(BATCH, T + NEW))
    checked = 0
    for mixer in w.mixers:
        for call in mixer.calls:
            part = call.conv
            kernel = kind.kernel(part.kernel)
            for how, hook in (("unchanged", lambda t, s: s), ("as new tensors", lambda t, s: s.clone())):
                inputs = {
                    name: value.clone() if name == kernel.state_in else value for name, value in part.inputs.items()
                }
                with torch.no_grad():
                    got = kernel.name_results(kernel.loop(**inputs, on_token=hook))
                if kernel.in_place:
                    got["final_state"] = inputs[kernel.state_in]
                for name, value in part.output.items():
                    if value is not None:
                        assert_close(
                            f"{case} {dtype} {mixer} call {call.index} {part.kernel} {name} ({how})",
                            value,
                            got[name],
                            rtol=0,
                            atol=0,
                        )
                        checked += 1
    assert checked, f"{case}: no conv kernel call was checked"
