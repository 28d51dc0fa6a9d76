"""The kind-agnostic part of the family bar, written once, over every registered family (`rh.FAMILIES`).

Each test builds the family's tiny model (tests/_models.py) and checks a promise that does not depend on
what the kind's memory is or where its kernels are bound: parity of a watch with the unwatched model,
greedy generate under hooks, that a hook-only watch keeps no tensor, the call counter, standalone hooks,
the gradient to the inputs, and bindings restored. What differs between families is read from the kind's
declarations (`MEMORIES`, `KERNELS`, `kernel_for`, `Kernel.target`) or given as data in `QUIRKS` and
`STATE_SHAPES` below. The kind-specific part of the bar (float64 references, kernels against transformers,
writes and where the memory is carried, the whole-memory identity, gradients of a kept state, quirks) is
in tests/test_families.py and tests/test_<kind>.py.
"""

import inspect

import pytest
import torch
from _compare import assert_close, assert_equal
from _models import FAMILIES as BUILDERS
from _models import build, random_ids
from _runs import greedy, logits_of
from _reachable import tensor_bytes_reachable

import recurrent_hooks as rh
from recurrent_hooks.engine.kernels import Site
from recurrent_hooks.engine.parts import map_parts, parts_of
from recurrent_hooks.engine.patching import bound_original, import_default
from recurrent_hooks.registry import family_of

FAMILIES = list(rh.FAMILIES)
T = 13  # not a multiple of anything

# Per-family quirks, as data; a family without a row takes DEFAULTS.
# - batch: the batch of every generate and one-token forward (rwkv decodes right with batch 1 only: with a state,
#   transformers' token shift broadcasts a one-token batch to [batch, batch, hidden], more-families.md bug 1);
# - loop_atol: how far the token loops may round from transformers' kernels (0: they make its operations in its
#   order, bit for bit);
# - backward_use_cache: the use_cache of a forward that is differentiated (False: transformers' own backward
#   through a cached forward fails, see the kind's LIMITS);
# - input_grad: (rtol, atol) of the input gradient through the token loops against the plain backward;
# - grad_parity: the lengths at which the logits of a grad-mode forward that keeps every memory are checked in
#   the parity test (every family's are at T, in the input-gradient test); every length where grad mode takes
#   a path of its own (a short convolution recomputes every position from its kept window).
DEFAULTS = dict(batch=2, loop_atol=1e-5, backward_use_cache=None, input_grad=(1e-4, 1e-7), grad_parity=())
_EXACT_LOOPS = dict(loop_atol=0.0)
_SHORT_CONV = dict(grad_parity=(1, 13, 70), **_EXACT_LOOPS)
QUIRKS = {
    "rwkv": dict(batch=1, backward_use_cache=False, **_EXACT_LOOPS),
    # a backward through a cached prompt >= chunk_size fails (5.24); the loop against transformers' chunk-wise
    # kernel: an mLSTM output divides by max(|n_t q|, e^(-m_t)), which can be small
    "xlstm": dict(backward_use_cache=False, input_grad=(1e-3, 1e-6)),
    **{name: _SHORT_CONV for name, row in rh.FAMILIES.items() if issubclass(row.kind, rh.ShortConvolution)},
    "zaya": dict(grad_parity=(13,), **_EXACT_LOOPS),  # its forward, operation for operation; grad mode recomputes
}
# The per-token shape after (batch, seq) of each memory (every part of a state of several parts), where pinned.
STATE_SHAPES = {
    "minimax": {"state": (2, 16, 16)},
    "recurrent_gemma": {"state": (32,), "conv_state": (32, 3)},
    "rwkv": {"state": (32,), "conv_state": (32,)},
    "zaya": {"state": (8,), "conv_state": (48, 2)},  # the value delay; the window over [q~; k~], K = 2
}
STACK = {"state": "states", "conv_state": "conv_states"}  # memory -> its keep name, and the mixer's per-token stack


def NOOP(mixer, call, token, state):  # a read-only hook that does nothing
    return None


def quirk(family, name):
    return QUIRKS.get(family, {}).get(name, DEFAULTS[name])


def test_every_family_has_a_tiny_model():
    assert sorted(FAMILIES) == sorted(BUILDERS), "a registered family has no builder in tests/_models.py"


def keep_all(family):
    """Every memory the kind carries, and the kernels' arguments and results."""
    return tuple(STACK[memory] for memory in rh.FAMILIES[family].kind.MEMORIES) + ("inputs", "outputs")


def hook_every_mixer(w, fn=NOOP, memories=None):
    """`fn` on every token of every mixer, for each of `memories` (default: the kind's first memory)."""
    for mixer in w.mixers:
        for memory in memories or type(mixer).MEMORIES[:1]:
            mixer.register_state_hook(fn, which=memory)


def norm(state):
    """The norm of a state, all its parts together."""
    return sum(float(part.norm()) ** 2 for _, part in parts_of(state)) ** 0.5


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
            assert_close("keep every memory, with gradients", plain, model(ids).logits.detach(),
                         rtol=max(tol["rtol"], 1e-6), atol=max(tol["atol"], 1e-6))
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
        w.mixers[0].register_state_hook(lambda m, c, t, s: norms.append((c, norm(s))) if m.head in (None, 0) else None,
                                        token=-1)
        for memory in seen:
            w.mixers[-1].register_state_hook(
                lambda m, c, t, s, memory=memory: seen[memory].append((c, t)) if m.head in (None, 0) else None,
                which=memory)
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
        assert [c.kernel for c in calls] == ([own.kernel_for("prompt").name]
                                             + [own.kernel_for("decode").name] * (N - 1))
        if "conv_state" in own.MEMORIES:
            assert [c.conv.kernel for c in calls] == ([own.kernel_for("prompt", "conv_state").name]
                                                      + [own.kernel_for("decode", "conv_state").name] * (N - 1))


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
    cached = quirk(family, "backward_use_cache")
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
    assert len(sites) == per_module * len(mixers) + len(row.kind.KERNELS) - per_module + fused, \
        "two kernels share a binding"
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
            w.mixers[0].register_state_hook(boom, token=3, which=memory)
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
    assert_close("model unchanged after the watches", logits_of(model, ids), logits_of(build(family), ids),
                 rtol=0, atol=0)
