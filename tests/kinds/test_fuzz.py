"""Fuzz tests, one per mixer kind: random prompts, writes, hooks and decode steps, three properties each.

The matrix in test_families.py checks each promise at a few hand-picked points (T = 13, a write at
token 7, a hook at token 40). Bugs in the dispatcher hide between such points: a stop on the last token
of a segment, a write at a decode step after a one-token prompt, a hook that must see what a write just
replaced, a prompt one token longer than a kernel's chunk. Hypothesis draws such cases for one tiny
family per mixer kind (qwen3_5, kimi_linear, mamba, zamba, mamba2):

- batch 1..3 and a prompt of T tokens: 1..12, and lengths around the chunk sizes (64 in the gated
  DeltaNet and Kimi prompt kernels, 16 in the library's chunk-wise kernels, 8 in mamba2's config);
- 0..3 decode steps of greedy `generate`;
- up to three edits on random layers, registered in a random order: `set_state_after`,
  `set_window_after` and `set_memory_after` at a random prompt token or decode step, with random
  values (zeros included), and state or convolution-window hooks at random calls and tokens, which
  record what they see and may scale it;
- what the fast run keeps: every state (the chunk-wise path) or a few positions (segments).

Each case runs twice, through the token loop (`paths=rh.Paths(rule="loop")`, every state, window and kernel
input kept) and through the fast paths (`paths=rh.Paths(rule="fixed")`). The properties:

1. The token loop's states, windows and hook inputs equal a float64 reference recomputed from each
   call's recorded kernel inputs, with the drawn edits applied at their tokens. Each call starts from
   the state and window the previous call ended with, writes included.
2. The fast run gives the same tokens, logits, hook inputs, kept states and windows, and took the path
   it should (segments, chunk-wise) where the kind has one.
3. The cache ends with the last state and window of the last call, in both runs, equal between them
   and to the reference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch
from _compare import assert_close, assert_equal
from _models import PAD, build, random_ids
from _reference import gated_delta_rule_reference, kimi_delta_rule_reference
from _reference_ssm import selective_scan_reference, ssd_reference
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import recurrent_hooks as rh
import recurrent_hooks.engine.dispatch.tap as rh_dispatch
import recurrent_hooks.engine.paths.runners as rh_busy

EVERYTHING = ("inputs", "outputs", "states", "windows")
STATES = dict(rtol=1e-4, atol=1e-6)  # float32 against float64, and fast paths against the token loop
LOGITS = dict(rtol=1e-4, atol=1e-5)
EXACT = dict(rtol=0, atol=0)

STATE_MEMORY, CONV_MEMORY = "state", "window"
WRITES = {
    "set_state_after": (STATE_MEMORY,),
    "set_window_after": (CONV_MEMORY,),
    "set_memory_after": (STATE_MEMORY, CONV_MEMORY),
}
HOOKS = {"state_hook": STATE_MEMORY, "conv_hook": CONV_MEMORY}


@dataclasses.dataclass(frozen=True)
class Kind:
    """One family standing for its mixer kind: how many mixers it has, and the prompt lengths to try
    besides 1..12 (around its chunk sizes)."""

    family: str
    mixers: int
    lengths: tuple[int, ...]


GATED_DELTANET = Kind("qwen3_5", 2, (16, 17, 33, 63, 64, 65, 70))
KIMI_DELTA = Kind("kimi_linear", 2, (16, 17, 33, 65))
SELECTIVE_SCAN = Kind("mamba", 2, (16, 17))
PER_HEAD_SELECTIVE_SCAN = Kind("zamba", 4, (17,))
STATE_SPACE = Kind("mamba2", 2, (8, 9, 16, 17, 33))


# -- the cases -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Edit:
    """One write or hook on `w.mixers[mixer]`.

    `method` is a write (`WRITES`) or a hook (`HOOKS`); `call` and `token` are passed as they are (None:
    every call / every token). `scale`: a write's values are standard normal times it; a hook returns
    the state times it, or None (keeps the state) when `scale` is None.
    """

    method: str
    mixer: int
    call: int | tuple[int, ...] | None
    token: int | tuple[int, ...] | None
    scale: float | None

    def memories(self) -> tuple[str, ...]:
        return WRITES[self.method] if self.method in WRITES else (HOOKS[self.method],)

    def targets(self, call: int) -> bool:
        return self.call is None or call == self.call or (isinstance(self.call, tuple) and call in self.call)


@dataclasses.dataclass(frozen=True)
class Case:
    batch: int
    prompt: int  # T, the prompt's tokens
    decode: int  # decode steps: generate makes 1 + decode calls
    edits: tuple[Edit, ...]  # in registration order
    keep: tuple[int, ...] | None  # the positions the fast run keeps; None: every state (chunk-wise)
    seed: int


def positions(token: int | tuple[int, ...] | None, tokens: int) -> list[int]:
    """The positions of a call of `tokens` tokens that `token` names (None: all; outside ones skipped)."""
    if token is None:
        return list(range(tokens))
    items = (token,) if isinstance(token, int) else token
    return sorted({t % tokens for t in items if -tokens <= t < tokens})


@st.composite
def edits(draw, kind: Kind, prompt: int, decode: int) -> Edit:
    method = draw(st.sampled_from([*WRITES, *HOOKS]))
    mixer = draw(st.integers(0, kind.mixers - 1))
    if method in WRITES:  # one call, one token of it
        call = draw(st.integers(0, decode))
        tokens = prompt if call == 0 else 1
        token = draw(st.integers(-tokens, tokens - 1))
        return Edit(method, mixer, call, token, draw(st.sampled_from([0.0, 0.1, 1.0])))
    calls = draw(st.sampled_from(["every", "one", "several"]))
    if calls == "every":
        call = None
    elif calls == "one":
        call = draw(st.integers(0, decode))
    else:
        call = tuple(draw(st.lists(st.integers(0, decode), min_size=1, max_size=2, unique=True)))
    # an explicit call must contain the hook's tokens; with call=None, calls without them are skipped
    tokens = prompt if call is None or call in (0, (0,)) else 1
    one = st.integers(-tokens, tokens - 1)
    token = draw(
        st.sampled_from(["one", "one", "several", "every"]).flatmap(
            lambda n: {
                "one": one,
                "several": st.lists(one, min_size=1, max_size=2, unique=True).map(tuple),
                "every": st.none(),
            }[n]
        )
    )
    return Edit(method, mixer, call, token, draw(st.sampled_from([None, 0.5, -1.0])))


@st.composite
def cases(draw, kind: Kind) -> Case:
    prompt = draw(st.one_of(st.integers(1, 12), st.sampled_from(kind.lengths)))
    decode = draw(st.integers(0, 3))
    # at most 3 edits of at most 2 tokens and 2 kept positions: at most 8 stops, so that a prompt whose
    # kernel has segments always runs in segments (unless a hook asks for every token)
    drawn = tuple(draw(st.lists(edits(kind, prompt, decode), max_size=3)))
    keep = draw(st.none() | st.lists(st.integers(-prompt, prompt - 1), min_size=1, max_size=2, unique=True).map(tuple))
    return Case(draw(st.integers(1, 3)), prompt, decode, drawn, keep, draw(st.integers(0, 2**16)))


# -- the two runs --------------------------------------------------------------------------------------------


@functools.cache
def model_of(family: str):
    """The family's tiny model (built once per module), and its state and window shapes without batch."""
    model = build(family)
    with rh.watch(model, keep=("states", "windows")) as w, torch.no_grad():
        model(random_ids(1, 1), use_cache=False)
    mixer = w.mixers[0]
    return model, tuple(mixer.state_after(0).shape[1:]), tuple(mixer.window_after(0).shape[1:])


def write_values(case: Case, family: str) -> list[rh.Memory]:
    """The values of every edit (used by writes only), the same for both runs."""
    _, state_shape, conv_shape = model_of(family)
    values = []
    for i, edit in enumerate(case.edits):
        gen = torch.Generator().manual_seed(case.seed + i)
        scale = edit.scale or 0.0
        values.append(
            rh.Memory(
                torch.randn((case.batch, *state_shape), generator=gen) * scale,
                torch.randn((case.batch, *conv_shape), generator=gen) * scale,
            )
        )
    return values


@contextlib.contextmanager
def patched(module, **attributes):
    before = {name: getattr(module, name) for name in attributes}
    for name, value in attributes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(module, name, value)


@dataclasses.dataclass
class Run:
    watch: rh.Watch
    out: object  # generate's output (sequences, logits, past_key_values)
    seen: dict[tuple[int, int, int | None, int], torch.Tensor]  # (edit, call, head, token) -> what the hook saw
    segmented: list[tuple[int, bool]]  # (layer, chunk-wise) of every kernel call run in segments


def run(case: Case, kind: Kind, values: list[rh.Memory], fast: bool) -> Run:
    model, _, _ = model_of(kind.family)
    seen, segmented = {}, []
    real = rh_busy.run_in_segments

    def spy(*args):
        if args[0].role == "prompt":  # (decode steps run in one segment too: their kernel, then the hooks)
            segmented.append((rh_dispatch.THREAD.running[-1].mixers[0].layer, bool(args[-1])))
        return real(*args)

    def hook_of(index: int, edit: Edit):
        def hook(mixer, call, token, state):
            seen[(index, call, mixer.head, token)] = state.clone()
            return None if edit.scale is None else state * edit.scale

        return hook

    if fast and case.keep is not None:
        keep = {"inputs": None, "outputs": None, "states": case.keep, "windows": case.keep}
    else:
        keep = EVERYTHING
    n = case.decode + 1
    # the fixed rule for the fast run: property 2 checks the path it takes, segments or chunk-wise, which the cost
    # model rarely picks at these tiny dims; the token loop for the slow run
    paths = rh.Paths(rule="fixed") if fast else rh.Paths(rule="loop")
    with patched(rh_busy, run_in_segments=spy), rh.watch(model, keep=keep, paths=paths) as w:
        assert len(w.mixers) == kind.mixers
        for i, (edit, value) in enumerate(zip(case.edits, values)):
            mixer = w.mixers[edit.mixer]
            if edit.method == "set_state_after":
                mixer.set_state_after(edit.token, value.state, call=edit.call)
            elif edit.method == "set_window_after":
                mixer.set_window_after(edit.token, value.window, call=edit.call)
            elif edit.method == "set_memory_after":
                mixer.set_memory_after(edit.token, value, call=edit.call)
            else:
                mixer.register_state_hook(hook_of(i, edit), call=edit.call, token=edit.token, memory=HOOKS[edit.method])
        out = model.generate(
            random_ids(case.batch, case.prompt, seed=case.seed),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=PAD,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return Run(w, out, seen, segmented)


# -- the float64 reference -----------------------------------------------------------------------------------
# Per kernel call: the token-major inputs of every token, the state it started from, and a function
# (inputs of some tokens, state before them) -> float64 states after each of them.


def _gated_delta(part):
    x = part.inputs
    reference = gated_delta_rule_reference if x["g"].dim() == 3 else kimi_delta_rule_reference
    per_token = {name: x[name] for name in ("query", "key", "value", "g", "beta")}

    def states(piece, state):
        return reference(**piece, initial_state=state, normalize_qk=x["use_qk_l2norm_in_kernel"])[1]

    return per_token, x["initial_state"], states


def _selective_scan(part):
    x = part.inputs
    if part.kernel == rh.SelectiveScan.kernel_for("prompt").name:  # channel-major, from zeros
        per_token = {name: x[name].transpose(1, 2) for name in ("hidden_states", "dt", "B", "C")}
        bias, softplus, start = x["delta_bias"], x["delta_softplus"], None
    else:
        per_token = {name: x[name][:, None] for name in ("hidden_states", "dt", "B", "C")}
        bias, softplus, start = x["dt_bias"], x["dt_softplus"], x["state"]

    def states(p, state):
        return selective_scan_reference(
            p["hidden_states"], p["dt"], x["A"], p["B"], p["C"], dt_bias=bias, softplus=softplus, initial_state=state
        )[1]

    return per_token, start, states


def _state_space(part):
    x = part.inputs
    if part.kernel == rh.Mamba2StateSpace.kernel_for("prompt").name:
        per_token = {name: x[name] for name in ("hidden_states", "dt", "B", "C")}
        A, bias, limit, start = x["A"], x["dt_bias"], x["dt_limit"], x["initial_states"]
    else:  # the decode kernel gets the per-head parameters expanded over head_dim: channel 0 is the head's
        per_token = {
            "hidden_states": x["hidden_states"][:, None],
            "dt": x["dt"][:, None, :, 0],
            "B": x["B"][:, None],
            "C": x["C"][:, None],
        }
        A, bias, limit, start = x["A"][:, 0, 0], x["dt_bias"], (-math.inf, math.inf), x["state"]
        bias = None if bias is None else bias[:, 0]

    def states(p, state):
        return ssd_reference(
            p["hidden_states"],
            p["dt"],
            A,
            p["B"],
            p["C"],
            dt_bias=bias,
            softplus=x["dt_softplus"],
            dt_limit=limit,
            initial_state=state,
        )[1]

    return per_token, start, states


RECURRENCES = {
    rh.GatedDeltaNet: _gated_delta,
    rh.KimiDeltaAttention: _gated_delta,
    rh.SelectiveScan: _selective_scan,
    rh.PerHeadSelectiveScan: _selective_scan,
    rh.Mamba2StateSpace: _state_space,
}


class Reference:
    """What the token loop should have computed, given the recorded kernel inputs and the drawn edits."""

    def __init__(self, case: Case, values: list[rh.Memory]):
        self.case, self.values = case, values
        self.seen: dict[tuple[int, int, int | None, int], torch.Tensor] = {}

    def _edit(
        self, index: int, memory: str, call: int, token: int, value: torch.Tensor, head: int | None, tokens: int
    ) -> torch.Tensor:
        """Apply every edit of mixer `index` on `memory` at (call, token), in registration order."""
        for i, edit in enumerate(self.case.edits):
            if (
                edit.mixer != index
                or memory not in edit.memories()
                or not edit.targets(call)
                or token not in positions(edit.token, tokens)
            ):
                continue
            if edit.method in WRITES:
                written = self.values[i].state if memory == STATE_MEMORY else self.values[i].window
                value = (written if head is None else written[:, head]).to(value.dtype)
            else:
                self.seen[(i, call, head, token)] = value
                if edit.scale is not None:
                    value = value * edit.scale
        return value

    def states(self, index: int, mixer: rh.RecurrentMixer, call: int) -> torch.Tensor:
        """The float64 states after every token of `call`, with the edits applied at their stops."""
        record = mixer.calls[call]
        tokens = record.tokens
        stops = sorted(
            {
                p
                for edit in self.case.edits
                if edit.mixer == index and STATE_MEMORY in edit.memories() and edit.targets(call)
                for p in positions(edit.token, tokens)
            }
        )
        heads = []
        for head, part in enumerate(record.kernel_calls):
            head = head if type(mixer).KERNEL_PER_HEAD else None  # zamba: one kernel call per head
            per_token, state, recurrence = RECURRENCES[type(mixer)](part)
            state = None if state is None else state.double()
            pieces, start = [], 0
            for end in [*(stop + 1 for stop in stops), tokens]:
                if end <= start:
                    continue
                piece = recurrence({name: v[:, start:end] for name, v in per_token.items()}, state)
                state = piece[:, -1]
                if end - 1 in stops:
                    state = self._edit(index, STATE_MEMORY, call, end - 1, state, head, tokens)
                    piece = torch.cat([piece[:, :-1], state[:, None]], dim=1)
                pieces.append(piece)
                start = end
            heads.append(torch.cat(pieces, dim=1))
        return heads[0] if len(heads) == 1 else torch.stack(heads, dim=2)

    def windows(self, index: int, mixer: rh.RecurrentMixer, call: int) -> torch.Tensor:
        """The convolution window after every token of `call`: the last kernel_size inputs, edits applied."""
        record = mixer.calls[call]
        x = record.conv.inputs["hidden_states"]
        size = record.conv.inputs["weight"].shape[-1]
        window = record.conv.inputs.get("conv_state")  # decode: the cached window
        if window is None:
            window = x.new_zeros((*x.shape[:2], size))
        offset = x.shape[-1] - record.tokens
        windows = []
        for p in range(x.shape[-1]):
            window = torch.cat([window[..., 1:], x[..., p : p + 1]], dim=-1)
            if p >= offset:
                window = self._edit(index, CONV_MEMORY, call, p - offset, window, None, record.tokens)
                windows.append(window)
        return torch.stack(windows, dim=1)


def state_in(mixer: rh.RecurrentMixer, call: int) -> torch.Tensor | None:
    """The state `call` started from, as its kernel received it (heads stacked for per-head mixers)."""
    record = mixer.calls[call]
    name = type(mixer).kernel(record.kernel).state_in
    states = [part.inputs.get(name) if name else None for part in record.kernel_calls]
    if any(state is None for state in states):
        return None
    return states[0] if len(states) == 1 else torch.stack(states, dim=1)


# -- the properties ------------------------------------------------------------------------------------------


def check_token_loop_against_reference(case: Case, values: list[rh.Memory], slow: Run) -> None:
    """Property 1, and property 3 for the token loop: the cache ends where the kept states end."""
    reference = Reference(case, values)
    calls = 1 + case.decode
    for index, mixer in enumerate(slow.watch.mixers):
        assert [c.tokens for c in mixer.calls] == [case.prompt] + [1] * case.decode, f"{mixer}: calls"
        for call in range(calls):
            record = mixer.calls[call]
            expected = reference.states(index, mixer, call)
            assert_close(
                f"{mixer} call {call}: states against the float64 reference", expected, record.states, **STATES
            )
            if call == calls - 1:
                last = expected[:, -1]
            assert_close(
                f"{mixer} call {call}: windows against the last inputs",
                reference.windows(index, mixer, call),
                record.windows,
                **EXACT,
            )
            start, window = state_in(mixer, call), record.conv.inputs.get("conv_state")
            if call == 0:
                assert start is None or not start.any(), f"{mixer}: the prompt did not start from zeros"
            else:  # what the cache handed over: the previous call's last state and window, writes included
                previous = mixer.calls[call - 1]
                assert_close(f"{mixer} call {call}: state in", previous.states[:, -1], start, **EXACT)
                assert_close(f"{mixer} call {call}: window in", previous.windows[:, -1], window, **EXACT)
        cache = slow.out.past_key_values
        assert_close(
            f"{mixer}: cached state after the run",
            mixer.calls[-1].states[:, -1],
            cache.get_recurrent_state(mixer.layer),
            **EXACT,
        )
        assert_close(
            f"{mixer}: cached state against the reference", last, cache.get_recurrent_state(mixer.layer), **STATES
        )
        cached_window = cache.get_conv_state(mixer.layer)
        assert_close(
            f"{mixer}: cached window after the run",
            mixer.calls[-1].windows[:, -1].to(cached_window.dtype),
            cached_window,
            **EXACT,
        )
    assert set(reference.seen) == set(slow.seen), (
        f"hooks ran at (edit, call, head, token) {sorted(slow.seen, key=str)}, not {sorted(reference.seen, key=str)}"
    )
    for key, expected in reference.seen.items():
        assert_close(f"hook input (edit, call, head, token) = {key}", expected, slow.seen[key], **STATES)


def check_fast_paths_against_token_loop(case: Case, slow: Run, fast: Run) -> None:
    """Property 2, and property 3 between the runs."""
    assert_equal("generated tokens", slow.out.sequences, fast.out.sequences)
    for step, (a, b) in enumerate(zip(slow.out.logits, fast.out.logits, strict=True)):
        assert_close(f"logits of call {step}", a, b, **LOGITS)
    assert set(slow.seen) == set(fast.seen), (
        f"fast hooks ran at (edit, call, head, token) {sorted(fast.seen, key=str)}, not {sorted(slow.seen, key=str)}"
    )
    for key, seen in slow.seen.items():
        assert_close(f"hook input (edit, call, head, token) = {key}", seen, fast.seen[key], **STATES)
    for index, (a, b) in enumerate(zip(slow.watch.mixers, fast.watch.mixers, strict=True)):
        for call in range(1 + case.decode):
            tokens = a.calls[call].tokens
            for token in range(tokens) if case.keep is None else positions(case.keep, tokens):
                assert_close(
                    f"{a} call {call}: state after {token}",
                    a.state_after(token, call),
                    b.state_after(token, call),
                    **STATES,
                )
                assert_close(
                    f"{a} call {call}: window after {token}",
                    a.window_after(token, call),
                    b.window_after(token, call),
                    **STATES,
                )
            if call:
                assert_close(f"{a} call {call}: state in", state_in(a, call), state_in(b, call), **STATES)
                assert_close(
                    f"{a} call {call}: window in",
                    a.calls[call].conv.inputs["conv_state"],
                    b.calls[call].conv.inputs["conv_state"],
                    **STATES,
                )
        for what in ("get_recurrent_state", "get_conv_state"):
            assert_close(
                f"{a}: cache {what}",
                getattr(slow.out.past_key_values, what)(a.layer),
                getattr(fast.out.past_key_values, what)(b.layer),
                **STATES,
            )
        # which path the prompt took: segments, unless a state hook on this mixer asks for every token
        segments = type(b).kernel_for("prompt").segments
        every_token = any(
            edit.mixer == index and edit.method == "state_hook" and edit.token is None and edit.targets(0)
            for edit in case.edits
        )
        chunkwise = (
            segments is not None
            and segments.all_states is not None
            and (case.keep is None or len(positions(case.keep, case.prompt)) == case.prompt)
        )
        # (a kind that runs its kernel once per head runs the segments once per head)
        expected = [] if segments is None or every_token else [(b.layer, chunkwise)] * len(b.calls[0].kernel_calls)
        assert [s for s in fast.segmented if s[0] == b.layer] == expected, f"{b}: the prompt took another path"
    assert not slow.segmented, "Paths(rule='loop') ran a kernel in segments"


def check(kind: Kind, case: Case) -> None:
    event(f"prompt {case.prompt}, decode steps {case.decode}")
    event("fast run keeps every state" if case.keep is None else "fast run keeps some positions")
    for edit in case.edits:
        event(f"edit {edit.method}")
    values = write_values(case, kind.family)
    slow = run(case, kind, values, fast=False)
    check_token_loop_against_reference(case, values, slow)
    check_fast_paths_against_token_loop(case, slow, run(case, kind, values, fast=True))


def edge_cases(kind: Kind):
    """Two cases every run tries first, whatever hypothesis draws (its draws change with its version)."""
    long, last = max(kind.lengths), kind.mixers - 1
    cases = [
        # a one-token prompt whose whole memory is written at its only token; hooks and a write at decode steps
        Case(
            2,
            1,
            2,
            (
                Edit("set_memory_after", 0, 0, 0, 1.0),
                Edit("state_hook", last, (1, 2), -1, 0.5),
                Edit("set_state_after", 0, 2, 0, 0.1),
            ),
            None,
            1,
        ),
        # a prompt longer than the kernels' chunks: a hook after a write at the same token, a window hook,
        # a few positions kept
        Case(
            1,
            long,
            1,
            (
                Edit("set_state_after", 0, 0, long - 2, 0.1),
                Edit("state_hook", 0, None, (long - 2, -1), -1.0),
                Edit("conv_hook", last, 0, 3, 0.5),
            ),
            (5, -1),
            2,
        ),
    ]

    def decorate(test):
        for case in reversed(cases):
            test = example(case=case)(test)
        return test

    return decorate


fuzz = settings(
    max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@fuzz
@given(case=cases(GATED_DELTANET))
@edge_cases(GATED_DELTANET)
def test_gated_deltanet_qwen3_5(case):
    check(GATED_DELTANET, case)


@fuzz
@given(case=cases(KIMI_DELTA))
@edge_cases(KIMI_DELTA)
def test_kimi_delta_attention_kimi_linear(case):
    check(KIMI_DELTA, case)


@fuzz
@given(case=cases(SELECTIVE_SCAN))
@edge_cases(SELECTIVE_SCAN)
def test_selective_scan_mamba(case):
    check(SELECTIVE_SCAN, case)


@fuzz
@given(case=cases(PER_HEAD_SELECTIVE_SCAN))
@edge_cases(PER_HEAD_SELECTIVE_SCAN)
def test_per_head_selective_scan_zamba(case):
    check(PER_HEAD_SELECTIVE_SCAN, case)


@fuzz
@given(case=cases(STATE_SPACE))
@edge_cases(STATE_SPACE)
def test_state_space_mamba2(case):
    check(STATE_SPACE, case)
