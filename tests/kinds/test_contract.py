"""The contract suite: the family bar, written once, over every registered family (`rh.FAMILIES`) and, for the
memory contract, every (family, mixer class).

Each test builds the family's tiny model (tests/helpers/_models.py) and checks a promise that does not depend on
what the kind's memory is or where its kernels are bound: parity of a watch with the unwatched model,
greedy generate under hooks, that a hook-only watch keeps no tensor, the call counter, standalone hooks,
the gradient to the inputs, and bindings restored. What differs between families is read from the kind's
declarations (`MEMORIES`, `KERNELS`, `kernel_for`, `Kernel.target`) and its quirks from its contract reading (below);
`STATE_SHAPES` pins a few families' shapes. The memory contract (split invariance, writes of every memory at
prompt tokens, after the prompt and at a decode step, a replacing hook as a write, the whole-memory identity,
the gradient to a kept memory, gradient checkpointing, left padding) reads each kind through its contract reading
(tests/helpers/_contract.py's `ContractReading`: how to make a write value, where the model carries a memory,
tolerances, quirks), which the kind's own test file declares where the defaults do not fit (`CONTRACT`). What is
particular to a kind (float64 references, kernels against transformers', its quirks) is in
tests/kinds/test_families.py and tests/kinds/test_<kind>.py.
"""

import importlib
import inspect

import pytest
import torch
from _compare import assert_close, assert_equal
from _contract import KIND_TESTS, READ, STACK, WRITE, cases, reading_of, whole_memory_model
from _models import FAMILIES as BUILDERS
from _models import build, random_ids
from _reachable import tensor_bytes_reachable
from _runs import greedy, left_padded, logits_of

import recurrent_hooks as rh
from recurrent_hooks.engine.binding.rebinding import bound_original, import_default
from recurrent_hooks.engine.declare.kernels import Site
from recurrent_hooks.engine.declare.memory_parts import map_parts, parts_of
from recurrent_hooks.engine.handle.kind import PADDING
from recurrent_hooks.registry import family_of

FAMILIES = list(rh.FAMILIES)
T = 13  # not a multiple of anything

# The per-token shape after (batch, seq) of each memory (every part of a state of several parts), where pinned.
STATE_SHAPES = {
    "minimax": {"state": (2, 16, 16)},
    "recurrent_gemma": {"state": (32,), "window": (32, 3)},
    "rwkv": {"state": (32,), "window": (32,)},
    "zaya": {"state": (8,), "window": (48, 2)},  # the value delay; the window over [q~; k~], K = 2
}


def NOOP(mixer, call, token, state):  # a read-only hook that does nothing
    return None


def quirk(family, name):
    """The reading's `name` for the family's (first) kind: its quirks (tests/helpers/_contract.py's ContractReading)."""
    return getattr(reading_of(rh.FAMILIES[family].kind), name)


def test_every_family_has_a_tiny_model():
    assert sorted(FAMILIES) == sorted(BUILDERS), "a registered family has no builder in tests/helpers/_models.py"


def test_every_contract_reading_is_found_where_its_kind_is():
    """A kind's test file declares how the contract reads it (`CONTRACT`, in tests/kinds/test_<the kind's module>.py;
    tests/helpers/_contract.py looks it up by that name): a reading anywhere else, or for a kind of another module,
    would be passed over silently, so each is checked to be the one its kind gets."""
    declared = [path.stem for path in sorted(KIND_TESTS.glob("test_*.py")) if "\nCONTRACT = " in path.read_text()]
    assert declared, "no test file declares a CONTRACT"
    for module in declared:
        for kind, reading in importlib.import_module(module).CONTRACT.items():
            assert reading_of(kind) is reading, (
                f"{module}.py declares the contract of {kind.__name__}, which is"
                f" read from test_{kind.__module__.rsplit('.', 1)[-1]}.py"
            )


def keep_all(family):
    """Every memory the kind carries, and the kernels' arguments and results."""
    return tuple(STACK[memory] for memory in rh.FAMILIES[family].kind.MEMORIES) + ("inputs", "outputs")


def hook_every_mixer(w, fn=NOOP, memories=None):
    """`fn` on every token of every mixer, for each of `memories` (default: the kind's first memory)."""
    for mixer in w.mixers:
        for memory in memories or type(mixer).MEMORIES[:1]:
            mixer.register_state_hook(fn, memory=memory)


def norm(state):
    """The norm of a state, all its parts together."""
    return sum(float(part.detach().norm()) ** 2 for _, part in parts_of(state)) ** 0.5


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def shared_model(family):
    """One model per family for the whole file: the tests only read it (a watch restores what it rebinds, which
    the bindings test checks against a fresh build, after every other test has used the model)."""
    return build(family)


@pytest.fixture
def model(shared_model):
    yield shared_model
    shared_model.zero_grad(set_to_none=True)


# -- parity with the unwatched model ---------------------------------------------------------------------------


@pytest.mark.parametrize("seq", [1, T, 70], ids=lambda s: f"T{s}")
def test_watched_logits_equal_unwatched(model, family, seq):
    """Idle: the plain model's logits bit for bit. Keeping every memory the kind carries (and, at the family's
    grad_parity lengths, keeping it with gradients), a no-op hook on its first memory, and no-op hooks on every
    memory: within the family's loop tolerance (bit for bit where the loops make transformers' operations in its
    order). The kept stacks have the kind's type and (batch, seq, per-token shape)."""
    ids = random_ids(quirk(family, "batch") if seq == 1 else 2, seq)
    tol = dict(rtol=quirk(family, "loop_atol"), atol=quirk(family, "loop_atol"))
    memories = rh.FAMILIES[family].kind.MEMORIES
    plain = logits_of(model, ids)
    with rh.watch(model):
        assert_close("idle watch", plain, logits_of(model, ids), rtol=0, atol=0)
    with rh.watch(model, keep=keep_all(family)) as w:
        assert_close("keep every memory", plain, logits_of(model, ids), **tol)
    kind = rh.FAMILIES[family].kind
    for memory in memories:
        stack = getattr(w.mixers[0], STACK[memory])
        wanted = kind.STATE_TYPE if memory == "state" and kind.STATE_TYPE is not None else torch.Tensor
        assert isinstance(stack, wanted), f"{memory}: a {type(stack).__name__}, expected a {wanted.__name__}"
        for name, part in parts_of(stack):
            shape = (ids.shape[0], seq, *STATE_SHAPES.get(family, {}).get(memory, part.shape[2:]))
            assert part.shape == shape, f"{memory} {name}: {tuple(part.shape)}, expected {shape}"
    if seq in quirk(family, "grad_parity"):
        with rh.watch(model, keep=keep_all(family)):  # grad mode: the token loops keep what the recurrence used
            assert_close(
                "keep every memory, with gradients",
                plain,
                model(ids).logits.detach(),
                rtol=max(tol["rtol"], 1e-6),
                atol=max(tol["atol"], 1e-6),
            )
    for hooked in dict.fromkeys((memories[:1], memories)):
        with rh.watch(model) as w:
            hook_every_mixer(w, NOOP, hooked)
            assert_close(f"no-op hooks on {' and '.join(hooked)}", plain, logits_of(model, ids), **tol)


def test_greedy_generate_is_identical(model, family):
    """Keeping every memory; no-op hooks on every token of every memory of every mixer, and on the first mixer a
    second hook that replaces its state by a copy (a replacement that changes nothing): the tokens of the
    unwatched generate."""
    ids = random_ids(quirk(family, "batch"), T)
    plain = greedy(model, ids, 6)
    with rh.watch(model, keep=keep_all(family)):
        assert_equal("tokens, keep every memory", plain, greedy(model, ids, 6))
    with rh.watch(model) as w:
        hook_every_mixer(w, NOOP, type(w.mixers[0]).MEMORIES)
        w.mixers[0].register_state_hook(lambda m, c, t, s: map_parts(torch.clone, s))
        assert_equal("tokens, hooks on every token, one replacing", plain, greedy(model, ids, 6))


N = 12  # calls of the hooked generate: the prompt and 11 decode steps


@pytest.fixture(scope="module")
def hooked_generate(shared_model, family):
    """One greedy generate of N calls under a watch that keeps nothing: a hook after the last token of each call of
    the first mixer (its state's norm), and hooks on every token of every memory of the last mixer. Returns the
    watch, what the hooks saw, and the bytes of tensor storage the watch held after it."""
    norms, seen = [], {memory: [] for memory in rh.FAMILIES[family].kind.MEMORIES}
    with rh.watch(shared_model) as w:
        w.mixers[0].register_state_hook(
            lambda m, c, t, s: norms.append((c, norm(s))) if m.head in (None, 0) else None, token=-1
        )
        for memory in seen:
            w.mixers[-1].register_state_hook(
                lambda m, c, t, s, memory=memory: seen[memory].append((c, t)) if m.head in (None, 0) else None,
                memory=memory,
            )
        greedy(shared_model, random_ids(quirk(family, "batch"), T), N)
    return w, norms, seen, tensor_bytes_reachable(w)


def test_a_hook_only_watch_keeps_no_tensor(hooked_generate):
    """A watch keeps only what keep names: hooks over a generation of 12 calls leave no tensor in the watch."""
    w, norms, _, held = hooked_generate
    assert len(w.mixers[0].calls) == N and [c for c, _ in norms] == list(range(N))
    assert all(value > 0 for _, value in norms)
    assert held == 0


# -- the call counter ---------------------------------------------------------------------------------------------


def test_call_counter_in_generate(hooked_generate, family):
    """Prompt = call 0 through the kind's prompt kernels, decode step k = call k through its decode kernels (one
    kernel may serve both), for every memory the kind carries; hooks see (call, token) in that order."""
    w, _, seen, _ = hooked_generate
    kind = rh.FAMILIES[family].kind
    expected = [(0, t) for t in range(T)] + [(k, 0) for k in range(1, N)]
    for memory in kind.MEMORIES:
        assert seen[memory] == expected, f"{memory} hooks saw {seen[memory]}"
    for mixer in w.mixers:
        calls = mixer.calls
        own = type(mixer)  # a family may have mixers of two kinds (inkling2's dynamic convolutions)
        assert [c.index for c in calls] == list(range(N))
        assert [c.tokens for c in calls] == [T] + [1] * (N - 1)
        assert [c.kernel for c in calls] == (
            [own.kernel_for("prompt").name] + [own.kernel_for("decode").name] * (N - 1)
        )
        if "window" in own.MEMORIES:
            assert [c.conv.kernel for c in calls] == (
                [own.kernel_for("prompt", "window").name] + [own.kernel_for("decode", "window").name] * (N - 1)
            )


def test_standalone_hooks_count_from_each_prompt(model, family):
    """Outside a watch, a call that starts from no cached memory is a prompt: each generate, and each forward
    with or without a cache, restarts at call 0 (hooks on the first and the last mixer module)."""
    mixers = [m for m in model.modules() if family_of(m) is not None]
    modules = list({id(m): m for m in (mixers[0], mixers[-1])}.values())
    seen = [[] for _ in modules]

    def recorder(out):
        return lambda m, c, t, s: out.append((c, t)) if m.head in (None, 0) else None

    handles = [rh.register_state_hook(module, recorder(out), token=-1) for module, out in zip(modules, seen)]
    batch = quirk(family, "batch")
    try:
        greedy(model, random_ids(batch, T), 3)
        greedy(model, random_ids(batch, 5, seed=2), 2)
        logits_of(model, random_ids(batch, 4))
        logits_of(model, random_ids(batch, 4), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    for calls in seen:
        assert calls == [(0, T - 1), (1, 0), (2, 0), (0, 4), (1, 0), (0, 3), (0, 3)]


# -- gradients ------------------------------------------------------------------------------------------------------


def test_gradient_flows_to_inputs_through_the_token_loops(model, family):
    """Keeping every memory in grad mode runs the token loops: the logits are the plain ones (within the loop
    tolerance) and the input embeddings get the plain gradient."""
    ids = random_ids(1, T)
    cached = quirk(family, "grad_use_cache")
    use_cache = {} if cached is None else {"use_cache": cached}
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=embeds, **use_cache).logits
    logits[0, -1].logsumexp(-1).backward()
    plain = embeds.grad.clone()
    embeds.grad = None
    with rh.watch(model, keep=keep_all(family)):
        watched = model(inputs_embeds=embeds, **use_cache).logits
        watched[0, -1].logsumexp(-1).backward()
    loop = max(quirk(family, "loop_atol"), 1e-6)
    assert_close("logits of the grad-mode forward", logits.detach(), watched.detach(), rtol=loop, atol=loop)
    assert plain.abs().max() > 0
    rtol, atol = quirk(family, "input_grad")
    assert_close("input gradient through the token loops", plain, embeds.grad, rtol=rtol, atol=atol)


# -- bindings ---------------------------------------------------------------------------------------------------------


_MISSING = object()


def binding_sites(model, family):
    """(owner, name, module) of every name a watch of `model` rebinds: each kernel where the kind declares it (a
    module global, a class attribute, or an attribute inside each mixer module: then `module` is that mixer
    module, else None) and the fused kernels."""
    row = rh.FAMILIES[family]
    modeling = row.module()
    mixers = [m for m in model.modules() if family_of(m) is not None]
    with rh.watch(model) as w:
        assert {id(m.module) for m in w.mixers} == {id(m) for m in mixers}, "the watch attached other modules"
    sites = {}
    for kernel in row.kind.KERNELS:
        for mixer in mixers if kernel.site is Site.INSTANCE else mixers[:1]:
            owner, name = row.classes[0].target(kernel, mixer)
            sites[id(owner), name] = (owner, name, mixer if kernel.site is Site.INSTANCE else None)
    for name in row.kind.FUSED:
        if hasattr(modeling, name):
            sites[id(modeling), name] = (modeling, name, None)
    per_module = sum(kernel.site is Site.INSTANCE for kernel in row.kind.KERNELS)
    fused = sum(hasattr(modeling, name) for name in row.kind.FUSED)
    assert len(sites) == per_module * len(mixers) + len(row.kind.KERNELS) - per_module + fused, (
        "two kernels share a binding"
    )
    return list(sites.values())


def bound(owner, name):
    """What `owner.name` holds now, as the owner holds it (a class: its attribute, descriptors unbound), and whether
    the owner holds it itself (its own `__dict__`)."""
    value = inspect.getattr_static(owner, name) if isinstance(owner, type) else getattr(owner, name)
    return value, vars(owner).get(name, _MISSING) is value


def test_bindings_restored_after_exit_after_a_raising_hook_and_when_nested(model, family):
    """Every rebound name holds, after a watch, a nested watch, a raising hook (on each memory) and a standalone
    hook, the very object it held before (`is`), where it held it; what a binding restores is what transformers
    bound at import (module globals and class attributes) and what idle calls run."""
    sites = binding_sites(model, family)
    before = {(id(owner), name): bound(owner, name) for owner, name, _ in sites}

    def unchanged(where, only=lambda module: True):
        for owner, name, module in sites:
            if not only(module):
                continue
            (now, own), (then, was_own) = bound(owner, name), before[id(owner), name]
            assert now is then and own == was_own, f"{where}: {owner!r}.{name} is not what it was"

    def ours(where, only=lambda module: True):
        for owner, name, module in sites:
            if not only(module):
                continue
            now, _ = bound(owner, name)
            assert getattr(now, "__recurrent_hooks__", False), f"{where}: {owner!r}.{name} is not rebound"
            assert bound_original(owner, name) is before[id(owner), name][0], f"{where}: {name} would restore another"

    for owner, name, module in sites:
        if module is None:  # a module global or a class attribute
            assert before[id(owner), name][0] is import_default(owner, name), f"{name} is not transformers' own"
    ids = random_ids(1, 5)
    with rh.watch(model):
        ours("inside a watch")
        with rh.watch(model) as inner:
            inner.mixers[0].register_state_hook(NOOP)
            logits_of(model, ids)
        ours("after a nested watch")
    unchanged("after the watches")

    def boom(mixer, call, token, state):
        raise KeyError("boom")

    for memory in rh.FAMILIES[family].kind.MEMORIES:
        with pytest.raises(KeyError, match="boom"), rh.watch(model) as w:
            w.mixers[0].register_state_hook(boom, token=3, memory=memory)
            logits_of(model, ids)
        unchanged(f"after a raising {memory} hook")
    first = next(m for m in model.modules() if family_of(m) is not None)
    handle = rh.register_state_hook(first, NOOP)
    try:  # an attribute inside a mixer module is rebound for the hooked module only
        ours("with a standalone hook", only=lambda module: module in (None, first))
        unchanged("another module, with a standalone hook", only=lambda module: module not in (None, first))
    finally:
        handle.remove()
    unchanged("after a standalone hook")
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert_close(
        "model unchanged after the watches", logits_of(model, ids), logits_of(build(family), ids), rtol=0, atol=0
    )


# -- the memory contract, over every (family, mixer class): tests/helpers/_contract.py says how each kind is read ------


CASES = cases()
_MODELS: dict[str, torch.nn.Module] = {}


def _ids(selected):
    return [case.id for case in selected]


def memory_cases(memory, covered=lambda case: True):
    return [case for case in CASES if memory in case.kind.MEMORIES and covered(case)]


def keep_every(case):
    """Every memory the kind carries, and the kernels' arguments and results."""
    return tuple(STACK[memory] for memory in case.kind.MEMORIES) + ("inputs", "outputs")


def model_of(case):
    """One model per family for the file (the tests only read it; a watch restores what it rebinds)."""
    if case.family not in _MODELS:
        _MODELS[case.family] = build(case.family)
    model = _MODELS[case.family]
    model.zero_grad(set_to_none=True)
    assert not model.training, "a test left the model in train mode"
    return model


def last_of(mixer, memory):
    """The memory after the last token of the mixer's last call, from its kept stack."""
    return map_parts(lambda stack: stack[:, -1], getattr(mixer, STACK[memory]))


def assert_memory_equal(name, expected, got):
    """Two memories (a tensor, or a state of several parts) bit for bit, part by part."""
    assert type(expected) is type(got) or not parts_of(expected)[0][0], (
        f"{name}: a {type(got).__name__}, expected a {type(expected).__name__}"
    )
    for (part, a), (_, b) in zip(parts_of(expected), parts_of(got)):
        assert_close(f"{name}{f', part {part}' if part else ''}", a, b.to(a.dtype), rtol=0, atol=0)


def started_from(case, mixer, memory, call, value):
    """The call started from `value`: its kernel's input (the state, or the window where recorded), else the window
    shifted by the call's first input (RG-LRU records no window input)."""
    if memory == "state":
        assert_memory_equal(f"call {call} started from the write", value, case.reading.state_in(mixer, call))
    elif case.reading.window_in is not None:
        assert_memory_equal(f"call {call} read the written window", value, case.reading.window_in(mixer, call))
    else:
        assert_close(
            f"call {call} shifted its input into the written window",
            value[..., 1:],
            mixer.window_after(0, call=call)[..., :-1],
            rtol=0,
            atol=0,
        )


def later_change(case, memory, change):
    reach = case.reading.state_reach if memory == "state" else case.reading.window_reach
    return change.min() if reach == "every" else change.max()


SPLITS = [case for case in CASES if case.reading.split_tol is not None]


@pytest.mark.parametrize("case", SPLITS, ids=_ids(SPLITS))
def test_decode_memories_continue_the_prompt_memories(case):
    """Split invariance: every memory at decode step k is the memory after token T+k-1 of one long prompt."""
    model, reading = model_of(case), case.reading
    tol = dict(reading.split_tol)
    relative = tol.pop("relative", False)
    with rh.watch(model, keep=keep_every(case)) as w:
        sequence = greedy(model, random_ids(reading.batch, T), 5)
    with rh.watch(model, keep=keep_every(case)) as whole:
        logits_of(model, sequence[:, :-1], use_cache=False)
    for mixer, long in zip(case.mixers(w), case.mixers(whole)):
        for memory in case.kind.MEMORIES:
            decoded = map_parts(
                lambda *stacks: torch.cat(stacks, dim=1), *(getattr(call, STACK[memory]) for call in mixer.calls)
            )
            for (name, expected), (_, got) in zip(parts_of(getattr(long, STACK[memory])), parts_of(decoded)):
                atol = tol["atol"] * float(expected.abs().max()) if relative else tol["atol"]
                assert_close(
                    f"{mixer} {memory} {name}: prompt + decode vs one prompt",
                    expected,
                    got,
                    rtol=tol["rtol"],
                    atol=atol,
                )


WRITES = [(case, "state", token) for case in memory_cases("state") for token in (0, 4, T - 1)]
WRITES += [(case, "window", token) for case in memory_cases("window") for token in case.reading.window_tokens]


@pytest.mark.parametrize("case, memory, token", WRITES, ids=[f"{c.id}-{m}-t{t}" for c, m, t in WRITES])
def test_a_write_changes_only_later_tokens_and_what_the_model_carries_on(case, memory, token):
    """A write after token t of a prompt: the logits at tokens <= t are the plain ones, the later ones move (every
    later token where the memory carries it on, some where a window forgets), the kept memory after t is the
    value written, and what the model carries to the next call (its Cache, module or `state=` list) is each
    mixer's last kept memory."""
    model, reading = model_of(case), case.reading
    ids = random_ids(2, T)
    plain = logits_of(model, ids)
    with rh.watch(model, keep=keep_every(case)) as w:
        logits_of(model, ids)
        value = reading.perturb(getattr(case.first(w), READ[memory])(token))
    with rh.watch(model, keep=keep_every(case)) as w:
        mixer = case.first(w)
        getattr(mixer, WRITE[memory])(token, value)
        with torch.no_grad():
            out = model(ids, use_cache=True)
    assert_close("logits at tokens <= t", plain[:, : token + 1], out.logits[:, : token + 1], **reading.early)
    if token < T - 1:
        change = (out.logits[:, token + 1 :] - plain[:, token + 1 :]).abs().amax(dim=(0, 2))
        assert later_change(case, memory, change) > reading.later, (
            f"a {memory} write at token {token} left later logits unchanged: {change}"
        )
    assert_memory_equal(f"{memory} after the write", value, getattr(mixer, READ[memory])(token))
    for other in case.mixers(w):
        for where, carried in reading.carried(out, other, memory).items():
            assert_memory_equal(f"{other}: {where} holds the continued {memory}", last_of(other, memory), carried)


STEERS = [(case, memory) for case in CASES for memory in case.kind.MEMORIES]


@pytest.mark.parametrize("case, memory", STEERS, ids=[f"{c.id}-{m}" for c, m in STEERS])
def test_a_write_after_the_last_prompt_token_steers_generation(case, memory):
    """A write after the last prompt token is what the first decode step starts from: the prompt's logits are the
    plain ones, the first decode step's move."""
    model, reading = model_of(case), case.reading
    ids = random_ids(reading.batch, T)
    kwargs = dict(output_logits=True, return_dict_in_generate=True)
    plain = greedy(model, ids, 3, **kwargs)
    with rh.watch(model, keep=keep_every(case)) as w:
        logits_of(model, ids)
        value = reading.perturb(getattr(case.first(w), READ[memory])(-1))
    with rh.watch(model, keep=keep_every(case)) as w:
        getattr(case.first(w), WRITE[memory])(T - 1, value)
        steered = greedy(model, ids, 3, **kwargs)
    started_from(case, case.first(w), memory, 1, value)
    assert_close("the prompt's logits", plain.logits[0], steered.logits[0], **reading.early)
    assert (plain.logits[1] - steered.logits[1]).abs().max() > reading.later, "the write did not steer step 1"


@pytest.mark.parametrize("case, memory", STEERS, ids=[f"{c.id}-{m}" for c, m in STEERS])
def test_a_write_at_a_decode_step(case, memory):
    """A write at decode call 2 leaves the logits of calls <= 2 as they were, changes later ones, and call 3
    continues from it."""
    model, reading = model_of(case), case.reading
    ids = random_ids(reading.batch, T)
    kwargs = dict(output_logits=True, return_dict_in_generate=True)
    plain = greedy(model, ids, 5, **kwargs)
    with rh.watch(model, keep=keep_every(case)) as w:
        greedy(model, ids, 5, **kwargs)
        value = reading.perturb(getattr(case.first(w), READ[memory])(0, call=2))
    with rh.watch(model, keep=keep_every(case)) as w:
        getattr(case.first(w), WRITE[memory])(0, value, call=2)
        steered = greedy(model, ids, 5, **kwargs)
    early = reading.decode_early or reading.early
    for step in range(3):
        assert_close(f"logits of call {step}", plain.logits[step], steered.logits[step], **early)
    change = max((plain.logits[step] - steered.logits[step]).abs().max() for step in range(3, 5))
    assert change > reading.later, f"a {memory} write at decode call 2 changed no later logits ({change})"
    started_from(case, case.first(w), memory, 3, value)


@pytest.mark.parametrize("case, memory", STEERS, ids=[f"{c.id}-{m}" for c, m in STEERS])
def test_a_replacing_hook_is_a_write(case, memory):
    """A hook that returns a memory is the same as writing it: the same logits bit for bit, the kept memory is the
    replacement, and the next hook on that memory sees the replacement."""
    model, reading = model_of(case), case.reading
    ids = random_ids(2, T)
    with rh.watch(model, keep=keep_every(case)) as w:
        logits_of(model, ids)
        value = reading.perturb(getattr(case.first(w), READ[memory])(4))
    with rh.watch(model, keep=keep_every(case)) as w:  # the same path as the hooked run's
        getattr(case.first(w), WRITE[memory])(4, value)
        written = logits_of(model, ids)
    seen = []

    def head_of(value, head):  # a per-head kind's hooks see (and return) the running head's slice of the state
        return value if head is None else value[:, head]

    with rh.watch(model, keep=keep_every(case)) as w:
        first = case.first(w)
        first.register_state_hook(lambda m, c, t, s: head_of(value, m.head), call=0, token=4, memory=memory)
        first.register_state_hook(
            lambda m, c, t, s: seen.append((m.head, map_parts(torch.clone, s))), call=0, token=4, memory=memory
        )
        hooked = logits_of(model, ids)
    assert_close("hook vs write", written, hooked, rtol=0, atol=0)
    assert seen, "the second hook did not run"
    for head, got in seen:  # once per head for per-head kinds: each head's slice of the replacement
        assert_memory_equal(f"the second hook saw the replacement (head {head})", head_of(value, head), got)
    assert_memory_equal(f"{memory} after the hook", value, getattr(first, READ[memory])(4))


def _first_outputs(model, case, ids, memory=None, token=None):
    """The first mixer module's output over `ids` (no cache), optionally with a whole memory written after `token`."""
    outputs = []
    with rh.watch(model, keep=keep_every(case)) as w, torch.no_grad():
        first = case.first(w)
        handle = first.module.register_forward_hook(
            lambda m, a, out: outputs.append(out[0] if isinstance(out, tuple) else out)
        )
        try:
            if memory is not None:
                first.set_memory_after(token, memory)
            model(ids, use_cache=False)
        finally:
            handle.remove()
    assert first.layer == 0, f"the first mixer is at layer {first.layer}: its inputs are not only tokens"
    return outputs[0], first


WHOLE = [case for case in CASES if not issubclass(case.kind, rh.DynamicShortConvolution)]  # not at layer 0: their
# identity, the module called on its own, is tests/kinds/test_dynamic_conv.py's


@pytest.mark.parametrize("case", WHOLE, ids=_ids(WHOLE))
def test_writing_the_whole_memory_makes_a_layer_continue_as_in_the_other_run(case):
    """Run A's whole memory (every memory the kind carries) after token t of the first mixer, written into run B,
    which shares A's tokens after t: the layer's outputs after t are A's, those up to t B's own. The memory is
    complete: nothing else carries over from tokens <= t. Of two memories, the state alone is not the whole one
    (B's own window still holds B's inputs); a window alone forgets: unwritten, B's outputs after t+K-1 are A's."""
    model, reading = (
        model_of(case) if case.reading.whole_memory_model is None else whole_memory_model(case),
        case.reading,
    )
    token = 6
    run_a = random_ids(2, T, seed=5)
    run_b = run_a.clone()
    run_b[:, : token + 1] = random_ids(2, token + 1, seed=6)
    out_a, mixer_a = _first_outputs(model, case, run_a)
    out_b, mixer_b = _first_outputs(model, case, run_b)
    assert (out_b[:, token + 1 :] - out_a[:, token + 1 :]).abs().max() > reading.later, "the two runs did not differ"
    memory = mixer_a.memory_after(token)
    assert (memory.state is None) == ("state" not in case.kind.MEMORIES)
    assert (memory.window is None) == ("window" not in case.kind.MEMORIES)
    patched, _ = _first_outputs(model, case, run_b, memory, token)
    assert_close(
        "layer output after t, memory written",
        out_a[:, token + 1 :],
        patched[:, token + 1 :],
        **reading.whole_memory_tol,
    )
    assert_close(
        "layer output up to t, B's own",
        out_b[:, : token + 1],
        patched[:, : token + 1],
        **(reading.whole_memory_early or reading.whole_memory_tol),
    )
    if memory.state is not None and memory.window is not None:
        state_only, _ = _first_outputs(model, case, run_b, rh.Memory(memory.state, mixer_b.window_after(token)), token)
        assert (state_only[:, token + 1] - out_a[:, token + 1]).abs().max() > reading.later, (
            "the state alone made B continue as A: the window carried nothing"
        )
    elif memory.state is None:
        size = mixer_a.windows.shape[-1]
        assert (out_b[:, token + 1 : token + size] - out_a[:, token + 1 : token + size]).abs().max() > reading.later
        assert_close("B after t+K-1, unwritten", out_a[:, token + size :], out_b[:, token + size :], rtol=0, atol=0)


# -- left padding: what each kind declares (`LEFT_PADDING`), checked ----------------------------------------------


def padded_row_differences(case, run):
    """The padded row's memories after its pads against the row alone's, as (name, expected, got, in generate): at
    every call of the generate, and in the plain forward (against the alone row's prompt); and its memories at the
    pads, in the generate's prompt and in the plain forward, as (name, values)."""
    compared, at_pads = [], []
    for mixer, ref, plain in zip(case.mixers(run.batch), case.mixers(run.alone), case.mixers(run.forward)):
        for memory in case.kind.MEMORIES:
            runs = [
                (f"call {call}", ref.calls[call], mixer.calls[call], run.pads if call == 0 else 0, True)
                for call in range(min(len(ref.calls), len(mixer.calls)))
            ]  # pads that enter may change tokens
            runs.append(("a plain forward", ref.calls[0], plain.calls[0], run.pads, False))
            for where, alone, padded, skip, in_generate in runs:
                for (part, a), (_, b) in zip(
                    parts_of(getattr(alone, STACK[memory])), parts_of(getattr(padded, STACK[memory]))
                ):
                    name = f"{mixer} {memory}{f' {part}' if part else ''}"
                    compared.append((f"{name}, padded row, {where}", a[0], b[0, skip:], in_generate))
                    if skip:
                        at_pads.append((f"{name} at the pads, {where}", b[0, :skip]))
    return compared, at_pads


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_a_left_padded_row_is_the_row_alone_as_the_kind_declares(case):
    """A left-padded row in a batch, at the prompt and at decode steps, against the same tokens alone, as the kind's
    `LEFT_PADDING` says: "masked" and "positions" (in generate, which gives the first real token position 0): its
    memories after the pads and its logits are the row's alone ("masked": the pads leave every memory at zero, in
    generate and in a plain forward too); "enters": the pads move them, and `support` says so. Under any
    declaration, a watch (keeping every memory, or hooking every mixer) generates what the unwatched model does."""
    model, how = model_of(case), case.kind.LEFT_PADDING
    assert how in PADDING, f"{case.kind.__name__}.LEFT_PADDING = {how!r}: expected one of {tuple(PADDING)}"
    run = left_padded(model, keep_every(case), T, rows=case.reading.batch)
    compared, at_pads = padded_row_differences(case, run)
    if how == "enters":
        moved = max(float((a - b).abs().max()) for _, a, b, _ in compared)
        assert moved > 1e-3, f"{case.kind.__name__} declares that pads enter the memory, but they moved it {moved:.1e}"
        rows = [row for row in rh.support(model) if row.kind == case.kind.__name__]
        assert rows and all("left padding" in row.unavailable for row in rows), "support does not say so"
    else:
        for name, expected, got, in_generate in compared:
            if in_generate or how == "masked":
                assert_close(name, expected, got, rtol=1e-4, atol=1e-6)
        assert len(run.single) == len(run.padded) == run.steps
        for step, (alone, padded) in enumerate(zip(run.single, run.padded)):
            assert_close(f"padded row logits, call {step}", alone[0], padded[0], rtol=1e-4, atol=1e-5)
    if how == "masked":
        for name, values in at_pads:
            assert_close(name, torch.zeros_like(values), values, rtol=0, atol=0)
        assert_close(
            "padded row logits, a plain forward", run.short_logits[0], run.logits[0, run.pads :], rtol=1e-4, atol=1e-5
        )
    plain, kept, hooked = run.generates(model, keep_every(case))
    assert_equal("padded greedy generate, every memory kept", plain, kept)
    assert_equal("padded greedy generate, a hook on every mixer", plain, hooked)


GRADIENTS = [(case, memory) for case, memory in STEERS if case.reading.grad_parts is None]


@pytest.mark.parametrize("case, memory", GRADIENTS, ids=[f"{c.id}-{m}" for c, m in GRADIENTS])
def test_the_gradient_reaches_a_kept_memory(case, memory):
    """d metric / d memory after token t: the kept memory is the tensor the later tokens read (its gradient is the
    one through a leaf written at t, part by part), and the gradient predicts a small change along it (a step of
    1% of the memory: small, yet well above float32 noise). Per-head kinds stack the heads' states into a new
    tensor: the gradient is taken through a written leaf (documented)."""
    model, reading = model_of(case), case.reading
    ids, token = random_ids(1, T), 5
    use_cache = {} if reading.grad_use_cache is None else {"use_cache": reading.grad_use_cache}
    with rh.watch(model, keep=keep_every(case)) as w:
        metric = model(ids, **use_cache).logits[0, -1].logsumexp(-1)
    first = case.first(w)
    kept = getattr(first, READ[memory])(token)
    leaf = map_parts(lambda part: part.detach().clone().requires_grad_(), kept)
    with rh.watch(model) as w:
        getattr(case.first(w), WRITE[memory])(token, leaf)
        model(ids, **use_cache).logits[0, -1].logsumexp(-1).backward()
    grad = map_parts(lambda part: part.grad, leaf)
    for name, part in parts_of(grad):
        assert part is not None and part.abs().max() > 0, f"no gradient reaches {memory} part {name!r}"
    if type(first).KERNEL_PER_HEAD and memory == "state":
        with pytest.raises(RuntimeError, match="not have been used in the graph"):
            torch.autograd.grad(metric, kept)
    else:
        through_kept = torch.autograd.grad(metric, [part for _, part in parts_of(kept)])
        for (name, part), other in zip(parts_of(grad), through_kept):
            assert_close(f"grad of the kept {memory} {name}", part, other, **reading.grad_tol)
    if memory in reading.finite_difference:
        eps = 1e-2 * norm(kept) / norm(grad)
        values = []
        for sign in (1, -1):
            with rh.watch(model) as w, torch.no_grad():
                moved = map_parts(lambda part, g: part.detach() + sign * eps * g, kept, grad)
                getattr(case.first(w), WRITE[memory])(token, moved)
                values.append(model(ids, **use_cache).logits[0, -1].logsumexp(-1))
        slope = (values[0] - values[1]) / (2 * eps)
        squared = sum((part * part).sum() for _, part in parts_of(grad))
        assert_close("directional derivative", squared, slope, rtol=2e-2, atol=1e-6)


CHECKPOINTING = {"off": None, "reentrant": True, "non-reentrant": False}


@pytest.mark.one_per_kind
@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
def test_gradient_checkpointing_gives_the_gradients_of_the_plain_backward(family, checkpointing):
    """A recompute repeats its call: a write at call 0, a replacing hook and kept memories (the kind's first memory)
    give the same loss, parameter gradients and kept-memory gradients with checkpointing (reentrant or not) as
    without; a read-only hook runs again in the recompute, with the same call and `recomputing` set. For every
    mixer class of the family (inkling2's static and dynamic convolutions)."""
    family_cases = [case for case in CASES if case.family == family]
    assert family_cases, f"{family} has no (family, mixer class) case"
    for case in family_cases:
        _checkpointed(case, checkpointing)


def _checkpointed(case, checkpointing):
    model, reading = model_of(case), case.reading
    memory = case.kind.MEMORIES[0]
    ids = random_ids(2, T)
    with rh.watch(model, keep={STACK[memory]: [3]}) as w, torch.no_grad():
        model(ids, use_cache=False)
    write = map_parts(torch.Tensor.detach, reading.perturb(getattr(case.first(w), READ[memory])(3), seed=2))
    per_head = type(case.first(w)).KERNEL_PER_HEAD and memory == "state"

    def backward(mode):
        model.train()
        model.zero_grad(set_to_none=True)
        if mode is None:
            model.activation_checkpointing_disable()
        else:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": mode})
        seen = []
        try:
            with rh.watch(model, keep={STACK[memory]: [5, -1]}) as w:
                first, last = case.first(w), case.mixers(w)[-1]
                getattr(first, WRITE[memory])(3, write)
                last.register_state_hook(lambda m, c, t, s: reading.scale(s), token=4, memory=memory)
                last.register_state_hook(lambda m, c, t, s: seen.append((c, t, m.recomputing)), token=6, memory=memory)
                loss = model(ids, use_cache=False).logits.square().mean()
                for _, part in parts_of(getattr(first, READ[memory])(5)):
                    if part.requires_grad:
                        part.retain_grad()  # reentrant: the forward ran without grad; its recompute retains it
                loss.backward()
            kept = dict(parts_of(getattr(first, READ[memory])(5)))
            memory_grad = None if per_head else {name: kept[name].grad for name in reading.grad_parts or kept}
            assert [c.index for c in first.calls] == [0], "a recompute counted as a new call"
        finally:
            model.activation_checkpointing_disable()
            model.eval()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, memory_grad, seen

    loss, grads, memory_grad, seen = backward(None)
    got_loss, got_grads, got_memory_grad, got_seen = backward(CHECKPOINTING[checkpointing])
    assert_close("loss", loss, got_loss, rtol=1e-6, atol=0)
    assert sorted(got_grads) == sorted(grads)
    scale = max(g.abs().max() for g in grads.values())
    for name, grad in grads.items():
        assert_close(f"grad of {name}", grad, got_grads[name], rtol=1e-4, atol=1e-5 * scale)
    if memory_grad is not None:
        assert all(part is not None and part.abs().max() > 0 for part in memory_grad.values()), memory_grad
        scale = max(part.abs().max() for part in memory_grad.values())
        for name, part in memory_grad.items():
            assert_close(f"grad of the kept {memory} {name}", part, got_memory_grad[name], rtol=1e-4, atol=1e-5 * scale)
    assert seen and all(hook == (0, 6, False) for hook in seen)  # once per head for per-head kinds
    assert got_seen[: len(seen)] == seen
    recomputed = got_seen[len(seen) :]  # zamba and zamba2 nest checkpointed layers: reentrant recomputes twice
    assert all(hook == (0, 6, True) for hook in recomputed)
    assert (len(recomputed) == 0) == (checkpointing == "off") and len(recomputed) % len(seen) == 0
    if reading.recomputes_once:
        assert len(recomputed) == (0 if checkpointing == "off" else len(seen)), got_seen
