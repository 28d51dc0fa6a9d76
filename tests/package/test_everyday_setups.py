"""Ordinary research setups that used to make the library wrong: what a default watch keeps, re-entrant and
threaded models, interrupts, generations that stop early, beam search, argument checks, unsupported mixers,
and standalone hooks whose handles are dropped. (Gradient checkpointing is in the family matrix.)"""

import gc
import importlib
import threading
import warnings

import pytest
import torch
import transformers
from _compare import assert_close, assert_equal
from _contract import in_segments, one_family_per_kind
from _models import PAD, build, random_ids
from _reachable import tensor_bytes_reachable
from _runs import halved, halved_around
from torch import nn

import recurrent_hooks as rh
import recurrent_hooks.engine.binding.rebinding as rh_patching
import recurrent_hooks.engine.standalone as standalone_impl
import recurrent_hooks.engine.tracking.threads as rh_threads
import recurrent_hooks.registry as rh_registry

T = 13
ONE_PER_KIND = one_family_per_kind(in_segments)  # the kinds with chunk-wise maths


def greedy(model, ids, n, **kwargs):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=PAD, **kwargs)


def states_of(model, ids, **kwargs):
    """Every state of every mixer (by layer) of one plain forward, kept alone in its own watch."""
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        logits = model(ids, **kwargs).logits
    return logits, {m.layer: m.states for m in w.mixers}


# -- 1. a default watch keeps nothing it was not asked for -------------------------------------------------------


def test_a_hook_only_watch_over_a_long_generation_keeps_no_tensor():
    model = build("qwen3_5")
    norms = []  # what the hook keeps: Python floats
    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: norms.append(float(s.norm())), token=-1)
        greedy(model, random_ids(1, T), 400)
    assert len(norms) == 400 and len(w.mixers[0].calls) == 400
    assert (w.mixers[0].calls[-1].kernel, w.mixers[0].calls[-1].tokens) == ("torch_recurrent_gated_delta_rule", 1)
    assert tensor_bytes_reachable(w) == 0
    with rh.watch(model, keep=("inputs",)) as kept:  # the yardstick: kept inputs are counted
        greedy(model, random_ids(1, T), 2)
    assert tensor_bytes_reachable(kept) > 0


# -- 2. a kernel call belongs to the mixer whose forward made it, in that thread ------------------------------------


@pytest.fixture(params=ONE_PER_KIND)
def two_models(request):
    """Two models of one family (one family per kind), with different weights."""
    return build(request.param, seed=0), build(request.param, seed=1)


def test_a_model_run_inside_a_hook_is_not_watched(two_models):
    a, b = two_models
    ids = random_ids(2, T)
    _, plain_a = states_of(a, ids)
    with torch.no_grad():
        plain_b_logits = b(ids).logits
    inner = []

    def run_b(mixer, call, token, state):
        inner.append(b(ids).logits)  # model B, same family, inside a hook of model A
        return None

    with rh.watch(a, keep=("states",)) as w, torch.no_grad():
        w.mixers[0].register_state_hook(run_b, token=[3, 7])
        w.mixers[1].register_state_hook(lambda m, c, t, s: a(ids[:, :4]) and None, token=5)  # A itself, unguarded
        a(ids)
    assert [len(m.calls) for m in w.mixers] == [1] * len(w.mixers)  # neither B nor A's inner run is a call of A's
    for mixer in w.mixers:
        assert_close(f"{mixer} states", plain_a[mixer.layer], mixer.states, rtol=1e-5, atol=1e-6)
    assert len(inner) >= 2  # per-head kinds (zamba) run the hook once per head
    for logits in inner:
        assert_equal("B's logits inside A's hook", plain_b_logits, logits)  # B ran its own kernels, untouched


def test_an_unwatched_model_run_inside_a_watched_forward_runs_its_own_kernels(two_models):
    """Model B run from a torch hook on a submodule of A's mixer: B's kernel calls are not A's."""
    a, b = two_models
    ids = random_ids(2, T)
    _, plain_a = states_of(a, ids)
    plain_b = b(ids).logits.detach()
    first = next(m for m in a.modules() if rh_registry.family_of(m) is not None)
    projection = next(m for m in first.children() if isinstance(m, nn.Linear))  # runs inside the mixer's forward
    w, inner = halved_around(a, b, ids, projection)  # B inside A's no_grad forward: its logits have no graph
    assert len(inner) == 1
    assert_equal("B's logits", plain_b, inner[0])
    assert len(w.mixers[0].calls) == 1 and w.mixers[0].states.shape[1] == T
    assert_close("A's states with the hook", halved(a, ids)[1].mixers[0].states, w.mixers[0].states, rtol=0, atol=0)


def test_two_threads_each_watching_their_own_model_get_their_own_states(two_models):
    a, b = two_models
    ids = {"a": random_ids(2, 70, seed=3), "b": random_ids(2, 70, seed=4)}
    models = {"a": a, "b": b}
    expected = {name: states_of(models[name], ids[name]) for name in models}
    halved_logits, _ = halved(a, ids["a"])
    rounds, barrier, failures = 12, threading.Barrier(2), []
    results = {name: [] for name in models}

    def work(name):
        try:
            for _ in range(rounds):
                barrier.wait()
                with rh.watch(models[name], keep=("states",)) as w, torch.no_grad():
                    if name == "a":  # a state-changing hook on A must not reach B
                        w.mixers[0].register_state_hook(lambda m, c, t, s: s * 0.5, token=None)
                    logits = models[name](ids[name]).logits
                results[name].append((logits, {m.layer: m.states for m in w.mixers}, [len(m.calls) for m in w.mixers]))
        except BaseException as error:  # reported by the main thread
            failures.append(error)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(name,)) for name in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    for name, runs in results.items():
        assert len(runs) == rounds
        logits, states = expected[name]
        for i, (got_logits, got_states, calls) in enumerate(runs):
            assert calls == [1] * len(calls), f"round {i} of {name}: calls {calls}"
            want_logits = halved_logits if name == "a" else logits
            assert_close(f"round {i} of {name}: logits", want_logits, got_logits, rtol=1e-5, atol=1e-6)
            if name == "b":
                for layer, state in states.items():
                    assert_close(f"round {i} of b: layer {layer}", state, got_states[layer], rtol=1e-5, atol=1e-6)


def test_an_unwatched_thread_runs_the_original_kernels(two_models):
    a, b = two_models
    ids = random_ids(2, 70)
    plain_b = b(ids).logits.detach()
    got, started, done = [], threading.Event(), threading.Event()

    def other():
        started.wait()
        with torch.no_grad():
            for _ in range(5):
                got.append(b(ids).logits)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with rh.watch(a) as w, torch.no_grad():
        w.mixers[0].register_state_hook(lambda m, c, t, s: s * 0.5)
        started.set()
        while not done.is_set():
            a(ids)
    thread.join()
    for logits in got:
        assert_equal("B in another thread", plain_b, logits)


def test_an_interrupt_from_a_hook_leaves_nothing_behind():
    model = build("qwen3_5")
    ids = random_ids(2, T)

    def interrupt(mixer, call, token, state):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with rh.watch(model) as w:
            w.mixers[0].register_state_hook(interrupt, call=2)
            greedy(model, ids, 4)
    assert rh_threads.THREAD.running == [] and rh_threads.THREAD.in_hook == 0
    handle = rh.register_state_hook(model.model.layers[0].linear_attn, interrupt, call=1)
    with pytest.raises(KeyboardInterrupt):
        greedy(model, ids, 4)
    handle.remove()
    assert rh_threads.THREAD.running == []
    logits, states = states_of(model, ids)  # and later watches work
    assert states[0].shape[1] == T


def test_an_interrupt_outside_a_kernel_leaves_no_entry():
    """A KeyboardInterrupt skips torch's post-forward hooks: the mixer's `__call__` pops its entry anyway."""
    model = build("qwen3_5")
    ids = random_ids(2, T)
    mixer_module = model.model.layers[0].linear_attn
    seen = []
    handle = rh.register_state_hook(mixer_module, lambda m, c, t, s: seen.append(c), token=-1)

    def interrupt(module, args, output):
        raise KeyboardInterrupt

    # runs after the kernels and before the tap's post-forward hook, which the interrupt then skips
    projection = mixer_module.register_forward_hook(interrupt, prepend=True)
    with pytest.raises(KeyboardInterrupt), torch.no_grad():
        model(ids)
    projection.remove()
    assert rh_threads.THREAD.running == []  # at once (tests/engine/test_ownership.py)
    with torch.no_grad():
        model(ids)
    handle.remove()
    assert rh_threads.THREAD.running == [] and seen == [0, 0]


# -- 4. generation that stops early is not an error ----------------------------------------------------------------


def test_hooks_on_calls_that_never_run_are_not_an_error():
    model = build("qwen3_5")
    ids = random_ids(2, T)
    steps = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with rh.watch(model) as w:
            w.mixers[0].register_state_hook(lambda m, c, t, s: steps.append(c), call=range(1, 1000))
            greedy(model, ids, 4)
    assert steps == [1, 2, 3]


def test_every_decode_step_is_slice_1_none():
    model = build("qwen3_5")
    ids = random_ids(2, T)
    seen = []
    value = torch.zeros(2, 4, 8, 8)
    with rh.watch(model, keep={"states": [-1]}) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: seen.append((c, t)), call=slice(1, None))
        w.mixers[1].set_state_after(0, value, call=slice(2, None, 2))  # decode steps 2, 4, ...
        greedy(model, ids, 6)
    assert seen == [(c, 0) for c in range(1, 6)]
    for call in range(6):
        is_written = call in (2, 4)
        assert bool((w.mixers[1].state_after(-1, call=call) == 0).all()) == is_written, call


def test_writes_on_calls_that_never_run_give_one_short_warning():
    model = build("qwen3_5")
    with pytest.warns(rh.RecurrentHooksWarning) as record:
        with rh.watch(model) as w:
            for mixer in w.mixers:
                mixer.set_state_after(0, torch.zeros(2, 4, 8, 8), call=range(1, 1000))
            greedy(model, random_ids(2, T), 4)
    (warning,) = record
    message = str(warning.message)
    assert len(message) < 500, message
    assert message.startswith("2 writes never ran: set_state_after(0, call=slice(1, 1000)) on GatedDeltaNet"
                              "(qwen3_5, layer 0) (call 4, 5, 6, ...; it saw 4 calls)")
    assert "generation may have stopped early" in message


# -- 5. beams, arguments, unsupported mixers, dropped handles --------------------------------------------------------


@pytest.mark.parametrize("family", ONE_PER_KIND)
def test_beam_search_decode_states_continue_the_reordered_rows(family):
    """Between decode steps beam search reorders the cache rows; `call.reorder` says how, and each decode step's
    kept states equal the float64 recurrence continued from the previous step's states, reordered."""
    model = build(family)
    with rh.watch(model, keep=("states", "inputs")) as w:
        greedy(model, random_ids(2, 9), 5, num_beams=3)
    for mixer in w.mixers:
        calls = mixer.calls
        assert calls[0].reorder is None and all(c.reorder is not None and c.reorder.shape == (6,) for c in calls[1:])
        assert any(not torch.equal(c.reorder, torch.arange(6)) for c in calls[1:]), "no beam was ever reordered"
        for k in range(1, len(calls)):
            before = mixer.state_after(-1, call=k - 1)[calls[k].reorder]
            assert_close(f"{mixer} call {k}: state in", before, _state_in(mixer, k), rtol=0, atol=0)
            assert_close(f"{mixer} call {k}: state", _reference_step(mixer, k, before), mixer.state_after(0, call=k),
                         rtol=1e-4, atol=1e-6)


def _state_in(mixer, k):
    parts = mixer.calls[k].kernel_calls
    name = type(mixer).kernel(mixer.calls[k].kernel).state_in
    states = [part.inputs[name] for part in parts]
    return states[0] if len(states) == 1 else torch.stack(states, dim=1)


def _reference_step(mixer, k, start):
    """The float64 state after decode step k from `start`, from the step's own kernel inputs."""
    import test_families

    parts = []
    for h, part in enumerate(mixer.calls[k].kernel_calls):
        x = dict(part.inputs)
        name = type(mixer).kernel(part.kernel).state_in
        x[name] = start if len(mixer.calls[k].kernel_calls) == 1 else start[:, h]
        for kind, reference in test_families.REFERENCES.items():
            if type(mixer) is kind:
                parts.append(reference(rh.KernelCall(part.kernel, x, None))[:, 0])
    return parts[0] if len(parts) == 1 else torch.stack(parts, dim=1)


@pytest.fixture
def watched():
    model = build("qwen3_5")
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        model(random_ids(2, T))
    return w


@pytest.mark.parametrize("token", [True, 4.0, "4", torch.tensor([4]), torch.tensor(4.0), None], ids=repr)
def test_reads_refuse_tokens_that_are_not_ints(watched, token):
    with pytest.raises(rh.InvalidValue, match=r"GatedDeltaNet\(qwen3_5, layer 0\)\.state_after: token must be an int"):
        watched.mixers[0].state_after(token)


def test_integer_0d_tensors_work_as_ints(watched):
    mixer = watched.mixers[0]
    assert_equal("state after tensor(4)", mixer.state_after(4), mixer.state_after(torch.tensor(4)))
    assert_equal("call tensor(0)", mixer.state_after(4), mixer.state_after(4, call=torch.tensor(0)))


@pytest.mark.parametrize(
    ("call", "kwargs", "message"),
    [
        (lambda m, s: m.set_state_after(True, s), {},
         r"set_state_after\(True, call=0\): token must be an int, got the bool"),
        (lambda m, s: m.set_state_after(4.0, s), {}, r"token must be an int, got float 4.0"),
        (lambda m, s: m.set_state_after(4, s, call=1.0), {}, r"call must be an int, got float 1.0"),
        (lambda m, s: m.set_state_after(4, s, call=slice(-1, None)), {}, r"a slice of calls needs start >= 0"),
        (lambda m, s: m.register_state_hook(lambda *a: None, token=4.0), {},
         r"register_state_hook: token must be an int"),
        (lambda m, s: m.register_state_hook(lambda *a: None, call=[0, True]), {}, r"call must be an int, got the bool"),
        (lambda m, s: m.register_state_hook(lambda *a: None, call=range(3, 3)), {},
         r"call=range\(3, 3\) targets no call"),
        (lambda m, s: m.set_memory_after(4, s), {}, r"expected a Memory\(state, window\), got Tensor"),
    ],
    ids=["bool token", "float token", "float call", "negative slice", "hook float token", "bool call", "empty range",
         "memory not a pair"],
)
def test_writes_and_hooks_refuse_bad_arguments(call, kwargs, message):
    model = build("qwen3_5")
    with rh.watch(model) as w:
        with pytest.raises(rh.InvalidValue, match=message):
            call(w.mixers[0], torch.zeros(2, 4, 8, 8))


def test_entry_points_refuse_bad_arguments():
    model = build("qwen3_5")
    with pytest.raises(rh.InvalidValue, match=r"watch: expected record=True or record=False, got record='no'"):
        rh.watch(model, record="no")
    with pytest.raises(rh.InvalidValue, match=r"watch: expected keep as a tuple of names or a mapping"):
        rh.watch(model, keep=5)
    with pytest.raises(rh.InvalidValue, match=r"watch: keep\['states'\] must be an int"):
        rh.watch(model, keep={"states": [1.5]})
    with pytest.raises(rh.InvalidValue, match=r"support: expected a torch.nn.Module \(a transformers model\), got str"):
        rh.support("hello")
    with pytest.raises(rh.InvalidValue, match=r"route_kernels: expected to= one of 'torch', 'default', 'recurrent',"
                                              r" 'chunked' for qwen3_5 \(GatedDeltaNet\), got 'fast'"):
        rh.route_kernels("qwen3_5", "fast")
    with rh.watch(model) as w:
        with pytest.raises(rh.InvalidValue, match=r"Watch.mixer: layer must be an int, got the bool True"):
            w.mixer(True)
        with pytest.raises(rh.InvalidValue, match=r"set_memory_after: expected a mapping of layer -> Memory"):
            w.set_memory_after(3, [1])
    assert not rh_patching._BINDINGS


def test_support_lists_both_kinds_of_short_convolution_of_a_family():
    """inkling2's dynamic short convolutions (an inline unfold, whose forward the library owns) are listed with their
    own kind, next to its static ones: one family, two kinds."""
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig

    config = Inkling2TextConfig(
        vocab_size=128, unpadded_vocab_size=128, hidden_size=32, num_hidden_layers=2,
        layer_types=["hybrid_sliding", "hybrid"], num_attention_heads=2, num_key_value_heads=1,
        swa_num_attention_heads=2, swa_num_key_value_heads=1, head_dim=16, swa_head_dim=16, sliding_window_size=8,
        d_rel=4, rel_extent=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        n_layers_per_attn_res_block=1)
    rows = rh.support(transformers.Inkling2ForCausalLM(config))
    dynamic = [r for r in rows if r.mixer_class == "Inkling2DynamicShortConvolution"]
    assert [r.path for r in dynamic] == ["model.layers.1.self_attn.k_proj.sconv",
                                         "model.layers.1.self_attn.v_proj.sconv"]
    assert all(r.family == "inkling2" and r.kind == "DynamicShortConvolution" for r in dynamic)
    assert {(r.family, r.kind) for r in rows if r not in dynamic} == {("inkling2", "ShortConvolution")}


def test_every_listed_unsupported_mixer_exists_in_transformers():
    # a loop, not a parametrization: the list may be empty (every recurrent family of transformers 5.24 is supported)
    for row in rh_registry.UNSUPPORTED:
        module = importlib.import_module(f"transformers.models.{row.family}.modeling_{row.family}")
        assert isinstance(getattr(module, row.mixer_class, None), type), f"{row} names no class of {module.__name__}"


def test_a_dropped_standalone_handle_keeps_its_hook_until_the_module_dies():
    """Like a torch module hook: dropping the handle leaves the hook; the kernels go back when the module dies."""
    model = build("qwen3_5")
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    seen = []
    rh.register_state_hook(model.model.layers[0].linear_attn, lambda m, c, t, s: seen.append(c), token=-1)
    gc.collect()
    with torch.no_grad():
        model(random_ids(1, 5))
    assert seen == [0] and ("transformers.models.qwen3_5.modeling_qwen3_5",
                            "torch_chunk_gated_delta_rule") in rh_patching._BINDINGS
    del model
    gc.collect()
    assert not rh_patching._BINDINGS and not standalone_impl._STANDALONE
    assert not getattr(module.torch_chunk_gated_delta_rule, "__recurrent_hooks__", False)
