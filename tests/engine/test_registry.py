"""A family is one row of the registry, and a row added at run time is found at once.

- A renamed copy of qwen3_5 (its modeling module loaded again under another name, its mixer class renamed), added
  with `recurrent_hooks.extend.register` after the lookups have been used, is watched like the original: the
  same states, its own kernels rebound and restored, `support` and `resolve_family` see it, without re-import.
- A duplicate (a family name, or a mixer class another family has) is refused naming both, and nothing is added.
- A family whose layers hold mixers of two kinds (inkling2) is one row: `family_of` gives that row for both
  classes, `mixer_of` each class's kind; owners of class- and instance-attribute kernels come from the row.
- A malformed row is refused naming what was expected and what arrived.
"""

import dataclasses
import inspect
import sys
import types

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids

import recurrent_hooks as rh
import recurrent_hooks.extend as extend
import recurrent_hooks.registry as registry
from recurrent_hooks.engine.binding import rebinding as patching
from recurrent_hooks.engine.declare.kernels import Site

RENAMED = "renamed_qwen"
MODULE = "renamed_qwen_pkg.modeling_renamed_qwen"


def _copy_of_qwen3_5(monkeypatch) -> types.ModuleType:
    """modeling_qwen3_5 executed again as a module of its own, with its mixer class renamed RenamedGatedDeltaNet
    (its relative imports resolve in transformers' qwen3_5 package, so it shares the configuration)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as original

    module = types.ModuleType(MODULE)
    module.__package__, module.__file__ = original.__package__, original.__file__
    monkeypatch.setitem(sys.modules, MODULE, module)  # transformers' decorators read the classes' source
    source = inspect.getsource(original).replace("Qwen3_5GatedDeltaNet", "RenamedGatedDeltaNet")
    exec(compile(source, original.__file__, "exec"), module.__dict__)
    return module


@pytest.fixture
def renamed(monkeypatch):
    """(the original qwen3_5 model, the renamed copy with its weights, the copy's modeling module)."""
    module = _copy_of_qwen3_5(monkeypatch)
    original = build("qwen3_5")
    copy = module.Qwen3_5ForCausalLM(original.config).eval()
    copy.load_state_dict(original.state_dict())
    yield original, copy, module
    for row in [row for row in rh.FAMILIES.values() if row.name == RENAMED]:
        registry.unregister(row)  # a failing test must not leave its row for the next


def _mixers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def test_a_renamed_copy_registered_at_run_time_is_watched_like_the_original(renamed):
    original, copy, module = renamed
    assert registry.family_of(_mixers(copy)[0]) is None  # the lookups are used (and built) before the row exists
    with pytest.raises(rh.Unavailable, match="no recurrent mixer of a supported family"):
        rh.watch(copy).__enter__()

    row = extend.Family(RENAMED, {"RenamedGatedDeltaNet": extend.GatedDeltaNet}, modeling=MODULE)
    extend.register(row)

    assert rh.FAMILIES[RENAMED] is row and row.module() is module
    assert all(registry.family_of(m) is row for m in _mixers(copy))
    assert registry.resolve_family(RENAMED) is row and registry.resolve_family(copy) is row
    assert registry.resolve_family(module) is row
    assert {(s.family, s.kind) for s in rh.support(copy)} == {(RENAMED, "GatedDeltaNet")}

    ids = random_ids(2, 9)
    with rh.watch(original, keep=("states", "windows")) as w0, torch.no_grad():
        expected = original(ids).logits
    with rh.watch(copy, keep=("states", "windows")) as w1, torch.no_grad():
        # the copy's own module global is what the watch rebound (the original module's is untouched)
        assert module.torch_chunk_gated_delta_rule is not patching.import_default(
            module, "torch_chunk_gated_delta_rule"
        )
        got = copy(ids).logits
    assert_close("logits", expected, got)
    assert [m.family for m in w1.mixers] == [RENAMED] * len(w0.mixers) and w1.mixers
    for a, b in zip(w0.mixers, w1.mixers):
        assert_close(f"layer {a.layer} states", a.states, b.states)
        assert_close(f"layer {a.layer} windows", a.windows, b.windows)
    assert module.torch_chunk_gated_delta_rule is patching.import_default(module, "torch_chunk_gated_delta_rule"), (
        "the watch left the copy's kernel rebound"
    )

    # a write too: the copy is steered as the original is
    written = w0.mixers[0].states[:, 3] * 0.5
    outputs = []
    for model in (original, copy):
        with rh.watch(model) as w, torch.no_grad():
            w.mixers[0].set_state_after(3, written)
            outputs.append(model(ids).logits)
    assert_close("logits after a write", outputs[0], outputs[1])
    assert (outputs[0] - expected).abs().max() > 1e-4, "the write changed nothing"

    registry.unregister(row)
    assert RENAMED not in rh.FAMILIES and registry.family_of(_mixers(copy)[0]) is None


def test_a_duplicate_registration_is_refused_and_adds_nothing(renamed):
    qwen = rh.FAMILIES["qwen3_5"]
    before = dict(rh.FAMILIES)
    with pytest.raises(rh.InvalidValue, match=r"family 'qwen3_5' is registered already.*Qwen3_5GatedDeltaNet"):
        extend.register(extend.Family("qwen3_5", {"Qwen3_5GatedDeltaNet": extend.GatedDeltaNet}))
    # the mixer class of another family, under a new name: refused naming the family that has it
    with pytest.raises(rh.InvalidValue, match=r"Qwen3_5GatedDeltaNet .*is a mixer class of the family 'qwen3_5'"):
        extend.register(
            extend.Family("qwen3_5_again", {"Qwen3_5GatedDeltaNet": extend.GatedDeltaNet}, modeling=qwen.module_name)
        )
    # a good row with a bad one: neither is added
    good = extend.Family(RENAMED, {"RenamedGatedDeltaNet": extend.GatedDeltaNet}, modeling=MODULE)
    with pytest.raises(rh.InvalidValue, match="registered already"):
        extend.register(good, extend.Family("lfm2", {"Lfm2ShortConv": extend.ShortConvolution}))
    with pytest.raises(rh.InvalidValue, match=f"family '{RENAMED}' is given twice"):
        extend.register(good, good)
    assert dict(rh.FAMILIES) == before and rh.FAMILIES["qwen3_5"] is qwen
    with pytest.raises(rh.InvalidValue, match="expected Family or Unsupported rows, got str"):
        extend.register("qwen3_5")
    with pytest.raises(TypeError):
        rh.FAMILIES["x"] = qwen  # a read-only view: rows are added by register, checked


def test_a_family_with_mixers_of_two_kinds_is_one_row():
    row = rh.FAMILIES["inkling2"]
    assert dict(row.mixers) == {
        "Inkling2ShortConvolution": rh.ShortConvolution,
        "Inkling2DynamicShortConvolution": rh.DynamicShortConvolution,
    }
    assert (row.mixer_class, row.kind) == ("Inkling2ShortConvolution", rh.ShortConvolution)  # the first
    model = build("inkling2")
    kinds = {}
    for module in model.modules():
        if (mixer := registry.mixer_of(module)) is not None:
            assert registry.family_of(module) is row and mixer.family is row and mixer.name == "inkling2"
            kinds[type(module).__name__] = mixer.kind
    assert kinds == dict(row.mixers)
    with rh.watch(model, keep=("windows",)) as w, torch.no_grad():
        model(random_ids(1, 5))
    assert {type(m) for m in w.mixers} == set(row.mixers.values())
    assert not hasattr(registry, "MORE_MIXERS") and not hasattr(extend, "MORE_MIXERS")


def test_owners_come_from_the_row_and_every_binding_exists():
    """No kernel names its owner (a transformers class or attribute path): the row does, defaulting to the mixer
    class (a class attribute) or the mixer module itself (an instance attribute); each class binding exists."""
    assert "owner" not in {field.name for field in dataclasses.fields(rh.Kernel)}
    gemma = rh.FAMILIES["recurrent_gemma"].classes[0]
    scan, forward = (gemma.kind.kernel(name) for name in ("_rnn_scan", "forward"))
    assert gemma.owner(scan) == "RecurrentGemmaRglru" and gemma.owner(forward) == "RecurrentGemmaRecurrentBlock"
    assert rh.FAMILIES["xlstm"].classes[0].owner(rh.FAMILIES["xlstm"].kind.kernel("_inference_fn")) == "mlstm_backend"
    for family in rh.FAMILIES.values():
        for mixer in family.classes:
            for kernel in mixer.kind.KERNELS:
                if kernel.site is Site.CLASS:
                    owner, name = mixer.target(kernel)
                    assert isinstance(owner, type) and name in vars(owner), f"{family.name}: {kernel.name} on {owner}"
                elif kernel.site is Site.MODULE:
                    assert mixer.owner(kernel) is None


def test_a_malformed_row_is_refused_naming_what_was_expected():
    with pytest.raises(rh.InvalidValue, match=r"Family\('x'\): expected at least one mixer class"):
        extend.Family("x", {})
    with pytest.raises(
        rh.InvalidValue,
        match=r"Family\('x'\): expected a RecurrentMixer subclass for the mixer"
        r" class 'XMixer', got int",
    ):
        extend.Family("x", {"XMixer": int})
    with pytest.raises(
        rh.InvalidValue,
        match=r"Family\('x'\): owners names '_scan', which is not a class- or"
        r" instance-attribute kernel of GatedDeltaNet",
    ):
        extend.Family("x", {"XMixer": extend.GatedDeltaNet}, owners={"_scan": "XScan"})
    with pytest.raises(rh.InvalidValue, match=r"Family: expected a family name \(a str\), got 3 \(int\)"):
        extend.Family(3, {"XMixer": extend.GatedDeltaNet})


def test_unsupported_rows_are_registered_and_found_lazily():
    import transformers

    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    attention = next(m for m in model.modules() if type(m).__name__ == "LlamaAttention")
    assert registry.unsupported_of(attention) is None
    row = extend.Unsupported("llama", "LlamaAttention", "a stand-in reason")
    extend.register(row)
    try:
        assert registry.unsupported_of(attention) is row and row in extend.UNSUPPORTED
        with pytest.raises(rh.InvalidValue, match="LlamaAttention of llama is listed as unsupported already"):
            extend.register(row)
    finally:
        registry.unregister(row)
    assert registry.unsupported_of(attention) is None and row not in extend.UNSUPPORTED


def test_route_kernels_routes_every_mixer_class_of_the_family():
    """inkling2's one row has two mixer classes: routing the family reroutes both (the dynamic convolutions'
    forward too, which the family's first row alone used to leave as it was), and the model computes the same."""
    row = rh.FAMILIES["inkling2"]
    targets = {mixer.mixer_class: [mixer.target(kernel) for kernel in mixer.kind.KERNELS] for mixer in row.classes}
    model, ids = build("inkling2"), random_ids(1, 6)
    with torch.no_grad():
        expected = model(ids).logits
    rh.route_kernels("inkling2", "torch")
    try:
        for cls, bindings in targets.items():
            for owner, name in bindings:
                assert patching.bound_original(owner, name) is not patching.import_default(owner, name), (
                    f"{cls}.{name} was not routed"
                )
        with torch.no_grad():
            got = model(ids).logits
    finally:
        rh.route_kernels("inkling2", "default")
    assert_close("logits through the token loops", expected, got, rtol=1e-4, atol=1e-5)
    for bindings in targets.values():
        for owner, name in bindings:
            assert patching.bound_original(owner, name) is patching.import_default(owner, name)
