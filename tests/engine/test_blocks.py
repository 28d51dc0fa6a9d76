"""The blocks path (`recurrent_hooks/engine/paths/blocks.py`): a hook on every token of a prompt, the states computed
chunk-wise a block at a time, against the token loop (`watch(model, paths=rh.Paths(rule="loop"))`).

For each kind whose prompt kernel has `Segments.all_states` (gated DeltaNet, Kimi delta attention, Mamba-2): the
same logits, hook inputs (token, call, state), kept states, cache contents and greedy generate; replacements (a
returned state, an in-place change, a write) in the middle of a block, at its boundaries and at the last token.
`BLOCK` is made small so that the tiny models' prompts span several blocks, and T is not a multiple of it.
"""

import dataclasses

import pytest
import torch
from _compare import assert_close, assert_equal
from _models import PAD, build, random_ids

import recurrent_hooks as rh
import recurrent_hooks.engine.paths.blocks as rh_blocks

FAMILIES = ["qwen3_5", "kimi_linear", "mamba2"]  # one family per kind with all_states
BLOCK = 4
T = 13  # blocks [0, 4) [4, 8) [8, 12) [12, 13)
TOL = {"rtol": 1e-4, "atol": 1e-6}


# The fixed rule: a hook on every token runs in blocks wherever `_blocks.blocks_apply` allows (the cost model would
# pick the token loop for qwen3_5 and kimi_linear at these tiny dims, and this file would not test blocks).
@pytest.fixture(scope="module", params=FAMILIES)
def shared_model(request):
    return build(request.param)


@pytest.fixture
def model(shared_model, monkeypatch):
    monkeypatch.setattr(rh_blocks, "BLOCK", BLOCK)
    yield shared_model
    assert not shared_model.training, "a test left the model in train mode"


@pytest.fixture
def spy(monkeypatch):
    """The calls of `run_in_blocks` (their token counts) and of the kernel's `all_states` inside them."""
    calls = {"blocks": [], "all_states": 0}
    real = rh_blocks.run_in_blocks

    def counted(kernel, args, kwargs, on_token, block=None):
        calls["blocks"].append(kernel.tokens(kernel.bind(args, kwargs), 0))
        segments = kernel.segments
        inner = segments.all_states

        def all_states(*a, **k):
            calls["all_states"] += 1
            return inner(*a, **k)

        kernel = dataclasses.replace(kernel, segments=dataclasses.replace(segments, all_states=all_states))
        return real(kernel, args, kwargs, on_token, block)

    monkeypatch.setattr(rh_blocks, "run_in_blocks", counted)
    return calls


def _blocks_run(replaced=()):
    """How many chunk-wise calls a prompt of T tokens takes with replacements at the `replaced` tokens: each
    ends its block there, and the next block starts after it."""
    start, count = 0, 0
    while start < T:
        end = min(start + BLOCK, T)
        start = min([t + 1 for t in replaced if start <= t < end] or [end])
        count += 1
    return count


def _recorder(seen, replace=None):
    """A hook on every token that records (call, token, state) and returns `replace(call, token, state)`."""

    def hook(m, c, t, s):
        seen.append((m.layer, c, t, s.clone()))
        return None if replace is None else replace(c, t, s)

    return hook


# every call with a hook on every token in blocks, whatever its kernel's blocks_below; the token loop
BLOCKS, LOOP = rh.Paths(rule="fixed", blocks_below=10**9), rh.Paths(rule="loop")


def _run(model, ids, fast, monkeypatch, replace=None, keep=None, writes=(), generate=0, blocks_below=10**9):
    """A forward (or greedy generate) with a hook on every token of every mixer, through one path (`fast`: blocks
    where the state has at most `blocks_below` elements; else the token loop)."""
    seen = []
    paths = rh.Paths(rule="fixed", blocks_below=blocks_below) if fast else LOOP
    with rh.watch(model, keep=keep or (), paths=paths) as w, torch.no_grad():
        for mixer in w.mixers:
            mixer.register_state_hook(_recorder(seen, replace))
            for token, value in writes:
                mixer.set_state_after(token, value(mixer))
        if generate:
            out = model.generate(
                ids,
                max_new_tokens=generate,
                do_sample=False,
                pad_token_id=PAD,
                output_logits=True,
                return_dict_in_generate=True,
            )
        else:
            out = model(ids, use_cache=True)
    return w, out, seen


def _assert_same(slow, fast):
    """Same logits, hook inputs and cache contents from two runs (`_run`'s results)."""
    (w_slow, out_slow, seen_slow), (w_fast, out_fast, seen_fast) = slow, fast
    if hasattr(out_slow, "sequences"):
        assert_equal("generated tokens", out_slow.sequences, out_fast.sequences)
        for step, (a, b) in enumerate(zip(out_slow.logits, out_fast.logits)):
            assert_close(f"logits of step {step}", a, b, rtol=1e-4, atol=1e-5)
    else:
        assert_close("logits", out_slow.logits, out_fast.logits, rtol=1e-4, atol=1e-5)
    assert [s[:3] for s in seen_slow] == [s[:3] for s in seen_fast], "hooks saw other (layer, call, token)s"
    for (layer, call, token, a), (_, _, _, b) in zip(seen_slow, seen_fast):
        assert_close(f"hook input, layer {layer} call {call} token {token}", a, b, **TOL)
    for a, b in zip(w_slow.mixers, w_fast.mixers):
        assert_close(
            f"{a} cached state",
            out_slow.past_key_values.get_recurrent_state(a.layer),
            out_fast.past_key_values.get_recurrent_state(b.layer),
            **TOL,
        )


def _assert_changed(plain, changed):
    """The replacements of `changed` changed the cache: the test is not vacuous."""
    layer = plain[0].mixers[0].layer
    a, b = (run[1].past_key_values.get_recurrent_state(layer) for run in (plain, changed))
    assert not torch.allclose(a, b), "the replacement changed nothing: a vacuous test"


def test_a_hook_on_every_token_runs_in_blocks_and_equals_the_token_loop(model, monkeypatch, spy):
    ids = random_ids(2, T)
    fast = _run(model, ids, True, monkeypatch)
    assert spy["blocks"] == [T] * len(fast[0].mixers), "the prompt calls did not run in blocks"
    assert spy["all_states"] == len(fast[0].mixers) * _blocks_run(), "a read-only hook made blocks restart"
    slow = _run(model, ids, False, monkeypatch)
    assert len(spy["blocks"]) == len(fast[0].mixers), "the token loop run went through blocks"
    assert len(fast[2]) == len(fast[0].mixers) * T
    _assert_same(slow, fast)


@pytest.mark.parametrize(
    "tokens", [(5,), (3,), (4,), (T - 1,), (3, 4, 9)], ids=["mid-block", "block-end", "block-start", "last", "several"]
)
def test_a_replacement_restarts_the_block_as_the_token_loop_continues(model, monkeypatch, spy, tokens):
    """A hook that returns a new state at some tokens: the later outputs, hook inputs and the cache follow it."""
    ids = random_ids(2, T)

    def replace(c, t, s):
        return s * 0.5 + 1.0 if t in tokens else None

    fast = _run(model, ids, True, monkeypatch, replace=replace)
    mixers = len(fast[0].mixers)
    assert spy["all_states"] == mixers * _blocks_run(tokens), "a replacement did not end its block"
    slow = _run(model, ids, False, monkeypatch, replace=replace)
    _assert_same(slow, fast)
    _assert_changed(_run(model, ids, True, monkeypatch), fast)


def test_an_in_place_change_counts_as_a_replacement(model, monkeypatch, spy):
    ids = random_ids(2, T)

    def replace(c, t, s):
        if t == 5:
            s.mul_(0.5).add_(1.0)  # returns None below: the change is in place only

    fast = _run(model, ids, True, monkeypatch, replace=replace)
    slow = _run(model, ids, False, monkeypatch, replace=replace)
    _assert_same(slow, fast)
    _assert_changed(_run(model, ids, True, monkeypatch), fast)


@pytest.mark.parametrize("keep", [{"states": [2, 5, 7, -1]}, ("states",)], ids=["some", "all"])
def test_writes_and_kept_states_with_a_hook_on_every_token(model, monkeypatch, spy, keep):
    ids = random_ids(2, T)
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        model(ids)
    values = {mixer.layer: mixer.state_after(7) * 0.5 for mixer in w.mixers}
    writes = [(6, lambda m: values[m.layer]), (8, lambda m: values[m.layer] + 1)]
    fast = _run(model, ids, True, monkeypatch, keep=keep, writes=writes)
    assert spy["blocks"], "the calls did not run in blocks"
    # the kept states are copies (a copy is no replacement): only the writes at 6 and 8 restart a block
    assert spy["all_states"] == len(fast[0].mixers) * _blocks_run((6, 8))
    slow = _run(model, ids, False, monkeypatch, keep=keep, writes=writes)
    _assert_same(slow, fast)
    for a, b in zip(slow[0].mixers, fast[0].mixers):
        tokens = range(T) if keep == ("states",) else (2, 5, 7, -1)
        for token in tokens:
            kept = b.state_after(token)
            assert_close(f"{a} state after {token}", a.state_after(token), kept, **TOL)
            assert kept.untyped_storage().nbytes() == kept.nbytes, "a kept state is a view into a block's buffer"
        cached = fast[1].past_key_values.get_recurrent_state(b.layer)
        assert cached.untyped_storage().nbytes() == cached.nbytes, "the cache holds a view into a block's buffer"


def test_greedy_generate_with_a_per_step_hook(model, monkeypatch, spy):
    ids = random_ids(2, T)

    def replace(c, t, s):
        return s * 0.9 if (c, t) in ((0, 6), (2, 0)) else None

    fast = _run(model, ids, True, monkeypatch, replace=replace, generate=4)
    assert spy["blocks"] == [T] * len(fast[0].mixers), "only the prompt runs in blocks"
    slow = _run(model, ids, False, monkeypatch, replace=replace, generate=4)
    _assert_same(slow, fast)


def test_gradients_on_or_inference_mode_keep_the_token_loop(model, monkeypatch, spy):
    """With gradients on, a kept state must be the tensor the recurrence used; inference tensors have no version
    counter, so an in-place change could not be seen: both run the token loop."""
    ids = random_ids(2, T)
    grads = []
    with rh.watch(model, paths=BLOCKS) as w, torch.enable_grad():
        w.mixers[0].register_state_hook(lambda m, c, t, s: grads.append(s.requires_grad))
        model(ids)
    with rh.watch(model, paths=BLOCKS) as w, torch.inference_mode():
        w.mixers[0].register_state_hook(lambda m, c, t, s: None)
        model(ids)
    assert spy["blocks"] == [] and len(grads) == T and all(grads)


def test_run_in_blocks_matches_the_loop_for_any_block_size(shared_model):
    """The kernel alone, with a replacement at token 9 and a final state: block sizes 1, 5, T and more than T."""
    with rh.watch(shared_model, keep=("inputs", "states")) as w, torch.no_grad():
        shared_model(random_ids(2, T))
    kind = type(w.mixers[0])
    kernel = kind.kernel_for("prompt")
    inputs = dict(w.mixers[0].calls[0].kernel_calls[0].inputs)
    flag = kernel.segments.final_flag
    inputs[flag] = True
    inputs[kernel.segments.state_in] = torch.randn_like(w.mixers[0].calls[0].states[:, 0])
    kwargs = {k: v for k, v in inputs.items() if k in kernel.signature.parameters}
    extra = {k: v for k, v in inputs.items() if k not in kwargs}

    def on_token(t, s):
        return s * 0.5 if t == 9 else s

    want_out, want_state = kernel.loop(**kwargs, **extra, on_token=on_token)
    for block in (1, 5, T, T + 3):
        with torch.no_grad():
            out, state = rh_blocks.run_in_blocks(kernel, (), {**kwargs, **extra}, on_token, block)
        assert_close(f"output, block {block}", want_out, out, **TOL)
        assert_close(f"final state, block {block}", want_state, state, **TOL)
        assert state.untyped_storage().nbytes() == state.nbytes, "the final state is a view into a block's buffer"


def test_blocks_are_chosen_by_the_size_of_the_state(model, monkeypatch, spy):
    """`state_size` reads the state's size off the kind's declarations (it equals the kept state's); a call runs
    in blocks when it is at most the limit (`Segments.blocks_below`, or `Paths(blocks_below=...)` when set)."""
    ids = random_ids(2, T)
    with rh.watch(model, keep=("states", "inputs")) as w, torch.no_grad():
        model(ids)
    mixer = w.mixers[0]
    kernel = type(mixer).kernel_for("prompt")
    size = rh_blocks.state_size(type(mixer), kernel, mixer.calls[0].kernel_calls[0].inputs)
    assert size == mixer.state_after(0).numel()
    for limit, runs in ((size - 1, False), (size, True), (None, size <= kernel.segments.blocks_below)):
        spy["blocks"].clear()
        _run(model, ids, True, monkeypatch, blocks_below=limit)
        assert bool(spy["blocks"]) == runs, f"limit {limit}, state of {size}: blocks {'not ' * runs}chosen"
