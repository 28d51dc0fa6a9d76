"""The public API on one family (qwen3_5): errors, hook targeting, handles, standalone hooks, routing, support."""

import importlib
import json

import pytest
import torch
import transformers
from _compare import assert_close
from _models import DEVICE, PAD, build, random_ids

import recurrent_hooks as rh
import recurrent_hooks.engine.attaching as attaching_impl
import recurrent_hooks.engine.binding.rebinding as rh_patching
import recurrent_hooks.registry as rh_registry

T = 13
MODULE = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
KERNELS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


@pytest.fixture
def model():
    return build("qwen3_5")


def bindings():
    return {name: getattr(MODULE, name) for name in KERNELS}


def run(model, ids=None, **kwargs):
    with torch.no_grad():
        return model(random_ids(2, T) if ids is None else ids, **kwargs).logits


def generate(model, n=4):
    with torch.no_grad():
        return model.generate(random_ids(2, T), max_new_tokens=n, do_sample=False, pad_token_id=PAD)


def attention_only_model():
    """A tiny Llama: attention layers only, no recurrent mixer."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return transformers.LlamaForCausalLM(config).eval()


def test_public_names_are_importable():
    for name in rh.__all__:
        assert getattr(rh, name) is not None, name


def test_the_extension_namespace_has_the_declarations_and_the_kinds_are_in_both():
    import recurrent_hooks.extend as extend

    for name in extend.__all__:
        assert getattr(extend, name) is not None, name
    assert not set(extend.__all__) & set(rh.__all__) - {"FAMILIES"}, "a name is public twice"
    for name in ("RecurrentMixer", "Kernel"):
        assert getattr(rh, name) is getattr(extend, name), name
    # every kind of the registry (and its state type) is in the extension namespace, by an explicit import that type
    # checkers see; recurrent_hooks keeps the kinds code written before that namespace finds there
    kinds = {cls.kind for row in rh.FAMILIES.values() for cls in row.classes}
    for value in kinds | {kind.STATE_TYPE for kind in kinds if kind.STATE_TYPE is not None}:
        name, module = value.__name__, value.__module__.removeprefix("recurrent_hooks")
        line = f"`from {module} import {name} as {name}`"
        assert getattr(extend, name, None) is value and name in extend.__all__, \
            f"recurrent_hooks.extend does not export {name}: add {line} and {name!r} to its __all__"
    for name in ("GatedDeltaNet", "KimiDeltaAttention", "SelectiveScan", "PerHeadSelectiveScan", "Mamba2StateSpace"):
        assert getattr(rh, name) is getattr(extend, name), name
    # the kinds' former names (StateSpace, LinearAttention) warn: tests/package/test_names.py


# -- errors --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (lambda s: torch.zeros(2, 4, 8), r"shape \(2, 4, 8\), expected \(2, 4, 8, 8\)"),
        (lambda s: torch.zeros_like(s, dtype=torch.float64), r"dtype torch.float64, expected torch.float32"),
        (lambda s: torch.zeros_like(s, device="meta"), rf"device meta, expected {DEVICE}"),
    ],
    ids=["shape", "dtype", "device"],
)
def test_a_written_state_that_does_not_fit_is_refused(model, value, message):
    with rh.watch(model, keep=("states",)) as w:
        run(model)
        state = w.mixers[0].state_after(3)
    before = bindings()
    with pytest.raises(rh.InvalidValue, match=r"GatedDeltaNet\(qwen3_5, layer 0\), call 0, token 3: "
                       r"set_state_after\(3, call=0\) gave a state with " + message):
        with rh.watch(model) as w:
            w.mixers[0].set_state_after(3, value(state))
            run(model)
    assert bindings() == before


def test_a_hook_returning_something_else_is_refused(model):
    with pytest.raises(rh.InvalidValue, match=r"layer 2\), call 0, token 4: state hook .* returned str"):
        with rh.watch(model) as w:
            w.mixers[1].register_state_hook(lambda m, c, t, s: "no", token=4)
            run(model)


def test_set_state_after_refuses_non_tensors_and_bad_calls(model):
    with rh.watch(model) as w:
        with pytest.raises(rh.InvalidValue, match="expected a Tensor with axes"):
            w.mixers[0].set_state_after(3, [[0.0]])
        with pytest.raises(rh.InvalidValue, match="calls count from 0, got call=-1"):
            w.mixers[0].set_state_after(3, torch.zeros(1), call=-1)
        with pytest.raises(rh.InvalidValue, match="expected a callable"):
            w.mixers[0].register_state_hook(None)
        with pytest.raises(rh.InvalidValue, match="token must be an int"):
            w.mixers[0].register_state_hook(lambda *a: None, token="last")


def test_a_token_outside_the_call_is_refused(model):
    with pytest.raises(rh.InvalidValue, match=r"layer 0\): set_state_after\(13, call=0\) targets token 13, but call 0 "
                       r"\(torch_chunk_gated_delta_rule\) has 13 tokens \(valid: 0..12 or -13..-1\)"):
        with rh.watch(model) as w:
            w.mixers[0].set_state_after(T, torch.zeros(2, 4, 8, 8))
            run(model)


def test_a_write_whose_call_never_happens_is_one_warning_when_the_watch_ends(model):
    with pytest.warns(rh.RecurrentHooksWarning, match=r"^1 write never ran: set_state_after\(0, call=5\) on "
                      r"GatedDeltaNet\(qwen3_5, layer 0\) \(call 5; it saw 4 calls\)\. The calls they target did"
                      r" not happen: generation may have stopped early"):
        with rh.watch(model) as w:
            w.mixers[0].set_state_after(0, torch.zeros(2, 4, 8, 8), call=5)
            generate(model, 4)
    assert bindings()[KERNELS[0]] is rh_patching.import_default(MODULE, KERNELS[0])


def test_reading_what_was_not_kept_or_does_not_exist(model):
    with rh.watch(model) as w:
        run(model)
    mixer = w.mixers[0]
    with pytest.raises(rh.Unavailable, match=r"GatedDeltaNet\(qwen3_5, layer 0\): call 0 kept no states; "
                       r"pass keep=\('states',\) to watch"):
        mixer.states
    with rh.watch(model, keep=("states",)) as w:
        run(model)
    with pytest.raises(rh.Unavailable, match=r"token 13 is outside call 0, which has 13 tokens"):
        w.mixers[0].state_after(T)
    with pytest.raises(rh.Unavailable, match=r"no call 1; this watch saw 1 calls"):
        w.mixers[0].state_after(0, call=1)
    assert_close("negative token", w.mixers[0].state_after(T - 1), w.mixers[0].state_after(-1), rtol=0, atol=0)
    with rh.watch(model) as w:
        with pytest.raises(rh.Unavailable, match="has not been called inside this watch yet"):
            w.mixers[0].states
        with pytest.raises(rh.Unavailable, match=r"no recurrent mixer at layer 1; recurrent layers: \[0, 2\]"):
            w.mixer(1)
    assert w.mixer(2) is w.mixers[1]


def test_an_unsupported_model_is_refused_with_the_reason(request):
    """A model without a supported mixer is refused naming the supported families, and the recurrent mixers it has
    that the library does not handle (`UNSUPPORTED`), with their reasons; `support` lists those with the reason.
    (Every recurrent family of transformers 5.24 is supported since zaya: a stand-in row tests the listing.)"""
    with pytest.raises(rh.Unavailable, match=r"LlamaForCausalLM contains no recurrent mixer of a supported family "
                       r"\(supported: qwen3_next, .*, zaya\)$"):
        with rh.watch(attention_only_model()):
            pass
    row = rh_registry.Unsupported("llama", "LlamaAttention", "a stand-in reason")
    rh_registry.register(row)
    request.addfinalizer(lambda: rh_registry.unregister(row))
    with pytest.raises(rh.Unavailable, match=r"\); it has LlamaAttention \(a stand-in reason\)$"):
        with rh.watch(attention_only_model()):
            pass
    rows = rh.support(attention_only_model())
    assert [row.mixer_class for row in rows] == ["LlamaAttention"]
    assert rows[0].family is None and rows[0].unavailable == {"everything": "a stand-in reason"}
    with pytest.raises(rh.InvalidValue, match="expected a torch.nn.Module"):
        rh.watch("qwen3_5")
    with pytest.raises(rh.InvalidValue, match=r"cannot keep \['state'\]; keep takes names from"):
        rh.watch(build("qwen3_5"), keep=("state",))


def test_hooks_after_the_watch_and_a_second_entry_are_refused(model):
    watcher = rh.watch(model)
    with watcher as w:
        with pytest.raises(rh.RecurrentHooksError, match="this watch is active already"):
            watcher.__enter__()
    with pytest.raises(rh.RecurrentHooksError, match="is detached .*register hooks inside the with block"):
        w.mixers[0].register_state_hook(lambda *a: None)


def test_entry_is_all_or_nothing(model, monkeypatch):
    real = attaching_impl.acquire_kernels
    calls = []

    def failing(*args):
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("second acquisition fails")
        return real(*args)

    monkeypatch.setattr(attaching_impl, "acquire_kernels", failing)
    before = bindings()
    with pytest.raises(RuntimeError, match="second acquisition fails"):
        rh.watch(model).__enter__()
    assert bindings() == before
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


# -- hook targeting and the state handed to hooks ------------------------------------------------------------


def test_hooks_target_calls_and_tokens(model):
    seen = {"all": [], "calls 0 and 2": [], "last token": [], "token 5 of every call": []}
    with rh.watch(model) as w:
        mixer = w.mixers[0]
        mixer.register_state_hook(lambda m, c, t, s: seen["all"].append((c, t)))
        mixer.register_state_hook(lambda m, c, t, s: seen["calls 0 and 2"].append((c, t)), call=[0, 2], token=[0, -1])
        mixer.register_state_hook(lambda m, c, t, s: seen["last token"].append((c, t)), token=-1)
        mixer.register_state_hook(lambda m, c, t, s: seen["token 5 of every call"].append((c, t)), token=5)
        generate(model, 4)
    assert seen["all"] == [(0, t) for t in range(T)] + [(1, 0), (2, 0), (3, 0)]
    assert seen["calls 0 and 2"] == [(0, 0), (0, T - 1), (2, 0)]  # in a 1-token call, 0 and -1 are one token
    assert seen["last token"] == [(0, T - 1), (1, 0), (2, 0), (3, 0)]
    assert seen["token 5 of every call"] == [(0, 5)]


def test_hooks_run_in_registration_order(model):
    order = []
    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: order.append("last token") or s * 2, token=-1)
        w.mixers[0].register_state_hook(lambda m, c, t, s: order.append(("every token", float(s.norm())))
                                        if t == T - 1 else None)
        run(model)
    assert order[0] == "last token" and order[1][0] == "every token"
    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: order.append(("before", float(s.norm()))) if t == T - 1
                                        else None)
        run(model)
    assert_close("the second hook saw the first one's replacement", torch.tensor(order[2][1]),
                 torch.tensor(order[1][1] * 0.5), rtol=1e-5, atol=0)


def test_hooks_receive_the_mixer_and_live_states_to_clone(model):
    """The state is handed over without a copy: a hook that keeps it clones it, and decode steps differ."""
    kept = []

    def keep(mixer, call, token, state):
        assert isinstance(mixer, rh.GatedDeltaNet) and mixer.layer == 0
        kept.append(state.clone())

    with rh.watch(model) as w:
        w.mixers[0].register_state_hook(keep, token=-1)
        generate(model, 4)
    assert len(kept) == 4
    assert all((a - b).abs().max() > 0 for a, b in zip(kept, kept[1:]))


def test_handles_are_removable_handles_idempotent_and_context_managers(model):
    hits = []
    with rh.watch(model) as w:
        handle = w.mixers[0].register_state_hook(lambda m, c, t, s: hits.append(t))
        assert isinstance(handle, torch.utils.hooks.RemovableHandle)
        run(model)
        handle.remove()
        handle.remove()
        run(model)
        with w.mixers[0].register_state_hook(lambda m, c, t, s: hits.append(-t)):
            run(model)
        run(model)
    assert hits == list(range(T)) + [-t for t in range(T)]


def test_a_hook_replacement_is_what_the_next_token_continues_from(model):
    """A hook returning a state at t acts exactly like set_state_after(t, that state)."""
    ids = random_ids(2, T)
    with rh.watch(model, keep=("states",)) as w:
        run(model, ids)
        value = w.mixers[1].state_after(6) * 3 + 0.01
    with rh.watch(model) as w:
        w.mixers[1].register_state_hook(lambda m, c, t, s: value, token=6)
        by_hook = run(model, ids)
    with rh.watch(model) as w:
        w.mixers[1].set_state_after(6, value)
        by_write = run(model, ids)
    assert_close("hook vs write", by_write, by_hook, rtol=0, atol=0)


def test_nested_watches_both_see_the_calls(model):
    ids = random_ids(2, T)
    with rh.watch(model, keep=("states",)) as outer:
        with rh.watch(model, keep=("states",)) as inner:
            inner.mixers[0].set_state_after(2, torch.zeros(2, 4, 8, 8))
            run(model, ids)
        run(model, ids)
    assert len(outer.mixers[0].calls) == 2 and len(inner.mixers[0].calls) == 1
    assert_close("outer saw the inner write", inner.mixers[0].calls[0].states, outer.mixers[0].calls[0].states,
                 rtol=0, atol=0)
    assert outer.mixers[0].calls[1].states[:, 2].abs().max() > 0


# -- hooks without a with block -------------------------------------------------------------------------------


def test_register_state_hook_without_a_watch_counts_from_each_prompt(model):
    seen = []
    before = bindings()
    handle = rh.register_state_hook(model.model.layers[0].linear_attn, lambda m, c, t, s: seen.append((c, t)), token=-1)
    assert isinstance(handle, torch.utils.hooks.RemovableHandle)
    assert all(getattr(f, "__recurrent_hooks__", False) for f in bindings().values())
    run(model)
    generate(model, 3)
    generate(model, 2)
    handle.remove()
    assert seen == [(0, T - 1), (0, T - 1), (1, 0), (2, 0), (0, T - 1), (1, 0)]
    assert bindings() == before
    run(model)
    assert len(seen) == 6


def test_standalone_hooks_share_the_binding_until_the_last_handle(model):
    before = bindings()
    mixer_module = model.model.layers[2].linear_attn
    first = rh.register_state_hook(mixer_module, lambda *a: None)
    second = rh.register_state_hook(mixer_module, lambda *a: None)
    first.remove()
    assert bindings() != before
    with rh.watch(model) as w:  # a watch beside a standalone hook
        run(model)
    second.remove()
    assert bindings() == before and len(w.mixers[1].calls) == 1
    with pytest.raises(rh.InvalidValue, match="expected a recurrent mixer module .* got Qwen3_5DecoderLayer"):
        rh.register_state_hook(model.model.layers[0], lambda *a: None)


def test_a_standalone_write_steers_generation(model):
    """The forward-hook workflow: a hook that returns a state steers every prompt it sees."""
    ids = random_ids(2, T)
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    handle = rh.register_state_hook(model.model.layers[0].linear_attn, lambda m, c, t, s: s * 10, call=0, token=-1)
    with torch.no_grad():
        steered = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
    handle.remove()
    assert_close("prompt logits unchanged", plain.logits[0], steered.logits[0], rtol=1e-5, atol=1e-5)
    assert (plain.logits[1] - steered.logits[1]).abs().max() > 1e-6


# -- routing and support ------------------------------------------------------------------------------------


def test_route_kernels_rebinds_process_wide_and_back(model):
    ids = random_ids(2, T)
    plain = run(model, ids)
    default = bindings()
    rh.route_kernels("qwen3_5", "torch")
    try:
        assert bindings()[KERNELS[0]] is rh.GatedDeltaNet.kernel(KERNELS[0]).loop
        assert_close("token-loop prompts", plain, run(model, ids), rtol=1e-5, atol=1e-5)
        with rh.watch(model, keep=("states",)) as w:
            with pytest.raises(rh.RecurrentHooksError, match="while a watch or a state hook is active"):
                rh.route_kernels(model, "default")
            run(model, ids)
        assert bindings()[KERNELS[0]] is rh.GatedDeltaNet.kernel(KERNELS[0]).loop
        assert w.mixers[0].states.shape == (2, T, 4, 8, 8)
    finally:
        rh.route_kernels(MODULE, "default")
    assert bindings() == default
    with pytest.raises(rh.InvalidValue, match=r"expected to= one of 'torch', 'default', 'recurrent', 'chunked'"
                                              r" for qwen3_5 \(GatedDeltaNet\), got 'fla'"):
        rh.route_kernels("qwen3_5", "fla")
    with pytest.raises(rh.Unavailable, match="unknown or unsupported family 'llama'"):
        rh.route_kernels("llama", "torch")


def test_support_reports_each_mixer(model):
    rows = rh.support(model)
    assert [(r.path, r.layer, r.family, r.kind) for r in rows] == [
        ("model.layers.0.linear_attn", 0, "qwen3_5", "GatedDeltaNet"),
        ("model.layers.2.linear_attn", 2, "qwen3_5", "GatedDeltaNet"),
    ]
    assert "states" in rows[0].available and "windows" in rows[0].available
    assert "packed sequences" in rows[0].unavailable
    assert "qwen3_5 -> GatedDeltaNet" in str(rows[0])
    assert rows[0].notes["a few tokens of a prompt"] == \
        "torch_chunk_gated_delta_rule in segments between them, or the token loop, by cost"
    assert rows[0].notes["a hook on every token"].startswith("chunk-wise blocks")
    # Mamba-1 prompts run in segments too (the library's own scan runs the pieces: Segments.kernel)
    assert rh.support(build("mamba"))[0].notes["a few tokens of a prompt"].endswith("in segments between them")


def test_reprs_say_what_is_watched(model):
    with rh.watch(model, keep=("states",)) as w:
        run(model)
        assert repr(w) == ("Watch(Qwen3_5ForCausalLM, active, keep=('states',),"
                           " mixers=[layer 0: 1 calls, layer 2: 1 calls])")
    assert repr(w.mixers[0]) == "GatedDeltaNet(qwen3_5, layer 0)"
    assert w.mixers[0].calls[0].kernel == "torch_chunk_gated_delta_rule"


def test_a_watch_keeps_kernel_inputs_and_outputs_only_when_asked(model):
    with rh.watch(model, keep=("states",)) as w:
        run(model)
    call = w.mixers[0].calls[0]
    assert (call.kernel, call.tokens, call.index) == ("torch_chunk_gated_delta_rule", T, 0)  # metadata is free
    with pytest.raises(rh.Unavailable, match=r"the kernel inputs of call 0 were not kept: pass keep=\('inputs',"
                       r" 'outputs'\) to watch"):
        call.inputs
    with pytest.raises(rh.Unavailable, match=r"the kernel inputs of call 0 were not kept"):
        w.mixers[0].values()
    assert call.kernel_calls[0].inputs is None and call.conv.inputs is None and w.mixers[0].states.shape[1] == T
    with rh.watch(model, keep=("inputs", "outputs")) as w:
        run(model)
    call = w.mixers[0].calls[0]
    assert set(call.output) == {"output", "final_state"} and call.inputs["value"].shape == (2, T, 4, 8)
    assert call.conv.inputs["hidden_states"].shape[1] == 64
    with rh.watch(model, keep=("outputs",)) as w:
        w.mixers[0].register_state_hook(lambda m, c, t, s: None)
        run(model)
    call = w.mixers[0].calls[0]
    assert call.kernel_calls[0].inputs is None and call.output["output"].shape == (2, T, 4, 8) and call.tokens == T


def test_the_support_command_reads_families_and_saved_configs(tmp_path, capsys):
    from recurrent_hooks.__main__ import main
    from recurrent_hooks.engine.binding.upstream import version_line

    assert main(["support", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["family"] for row in rows if row["kind"]} == set(rh.FAMILIES)
    assert any(row["mixer_class"] == "ZayaCCAProjection" and row["kind"] == "CompressedConvolutionalAttention"
               for row in rows)
    assert [row for row in rows if row["kind"] is None] == [
        {"family": row.family, "mixer_class": row.mixer_class, "kind": None, "available": [],
         "unavailable": {"everything": row.reason}} for row in rh_registry.UNSUPPORTED]
    assert any(row["mixer_class"] == "Inkling2DynamicShortConvolution" and row["kind"] == "DynamicShortConvolution"
               for row in rows)
    assert main(["support", "mamba2"]) == 0
    assert capsys.readouterr().out.startswith(f"{version_line()}\nmamba2: Mamba2Mixer -> Mamba2StateSpace")
    build("jamba").save_pretrained(tmp_path)
    assert main(["support", str(tmp_path / "config.json"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(row["path"], row["kind"]) for row in rows] == [("model.layers.0.mamba", "SelectiveScan"),
                                                             ("model.layers.2.mamba", "SelectiveScan")]
    assert main(["support", "no_such_family"]) == 2
    assert "is neither a family" in capsys.readouterr().err


def test_route_kernels_speaks_each_kinds_words():
    rh.route_kernels("qwen3_5", "recurrent")
    try:
        assert bindings()[KERNELS[0]] is rh.GatedDeltaNet.kernel(KERNELS[0]).loop
    finally:
        rh.route_kernels("qwen3_5", "chunked")
    assert bindings()[KERNELS[0]] is rh_patching.import_default(MODULE, KERNELS[0])
    with pytest.raises(rh.InvalidValue, match=r"expected to= one of 'torch', 'default' for mamba \(SelectiveScan\)"):
        rh.route_kernels("mamba", "recurrent")


def test_a_call_reads_its_memories_by_name_and_says_where_they_were_replaced():
    """`Call.kept(memory)`, `after(memory, token)`, `ran(memory)` and `replaced(memory)`: the record's own readers,
    by the memory's name, as the mixer's `states`, `windows` and `state_after` read them."""
    model = build("qwen3_5")
    with rh.watch(model, keep=("states", "windows")) as w:
        mix = w.mixers[0]
        mix.register_state_hook(lambda mixer, call, token, state: state * 0.5 if token == 3 else None)
        model(random_ids(1, 8))
    call = mix.calls[0]
    assert call.kept("state") is call.states and call.kept("window") is call.windows
    assert_close("state after 2", mix.state_after(2), call.after("state", 2), rtol=0, atol=0)
    assert_close("window after -1", mix.window_after(-1), call.after("window", -1), rtol=0, atol=0)
    assert call.ran("state") == call.ran("window") == call.tokens == 8
    assert call.replaced() == frozenset({3}) and call.replaced("window") == frozenset()
    with pytest.raises(rh.InvalidValue, match="expected a memory, one of 'state', 'window', got 'states'"):
        call.kept("states")
    assert_close("mix.after", mix.state_after([1, 2]), mix.after("state", [1, 2]), rtol=0, atol=0)
    with pytest.raises(rh.InvalidValue, match="expected memory='state' or memory='window', got 'states'"):
        mix.after("states", 2)


def test_set_after_writes_the_memory_it_names():
    """`mix.set_after(memory, token, value)` is `set_state_after` / `set_window_after` by the memory's name."""
    model, ids = build("qwen3_5"), random_ids(1, 8)
    with rh.watch(model, keep=("states", "windows")) as w, torch.no_grad():
        model(ids)
    state, window = w.mixers[0].state_after(2) * 0.5, w.mixers[0].window_after(2) * 0.5
    runs = {}
    for name, write in {"generic": lambda mix: (mix.set_after("state", 2, state), mix.set_after("window", 2, window)),
                        "named": lambda mix: (mix.set_state_after(2, state), mix.set_window_after(2, window))}.items():
        with rh.watch(model) as v, torch.no_grad():
            write(v.mixers[0])
            runs[name] = model(ids).logits
    assert_close("set_after vs set_state_after and set_window_after", runs["named"], runs["generic"], rtol=0, atol=0)
