"""The entry points beside `watch`, on qwen3_5 (and a few other families): `route_kernels` rebinds a family's kernels
process-wide to what the words of its kind name and back, refusing while a watch or a state hook is active; `support`
and the `support` command list every recurrent mixer of a model, a family or a saved config with what it offers and
what it does not, and each mixer the library does not handle with the reason that `watch` gives when it refuses the
model."""

import importlib
import json

import pytest
import transformers
from _compare import assert_close
from _models import build, random_ids
from _qwen3_5 import KERNELS, MODULE, T, bindings, run

import recurrent_hooks as rh
import recurrent_hooks.engine.binding.rebinding as rh_patching
import recurrent_hooks.registry as rh_registry


@pytest.fixture
def model():
    return build("qwen3_5")


def attention_only_model():
    """A tiny Llama: attention layers only, no recurrent mixer."""
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    return transformers.LlamaForCausalLM(config).eval()


# -- route_kernels ----------------------------------------------------------------------------------------------------


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
    with pytest.raises(
        rh.InvalidValue,
        match=r"expected to= one of 'torch', 'default', 'recurrent', 'chunked'"
        r" for qwen3_5 \(GatedDeltaNet\), got 'fla'",
    ):
        rh.route_kernels("qwen3_5", "fla")
    with pytest.raises(rh.Unavailable, match="unknown or unsupported family 'llama'"):
        rh.route_kernels("llama", "torch")


def test_route_kernels_speaks_each_kinds_words():
    rh.route_kernels("qwen3_5", "recurrent")
    try:
        assert bindings()[KERNELS[0]] is rh.GatedDeltaNet.kernel(KERNELS[0]).loop
    finally:
        rh.route_kernels("qwen3_5", "chunked")
    assert bindings()[KERNELS[0]] is rh_patching.import_default(MODULE, KERNELS[0])
    with pytest.raises(rh.InvalidValue, match=r"expected to= one of 'torch', 'default' for mamba \(SelectiveScan\)"):
        rh.route_kernels("mamba", "recurrent")


# -- support ----------------------------------------------------------------------------------------------------------


def test_support_reports_each_mixer(model):
    rows = rh.support(model)
    assert [(r.path, r.layer, r.family, r.kind) for r in rows] == [
        ("model.layers.0.linear_attn", 0, "qwen3_5", "GatedDeltaNet"),
        ("model.layers.2.linear_attn", 2, "qwen3_5", "GatedDeltaNet"),
    ]
    assert "states" in rows[0].available and "windows" in rows[0].available
    assert "packed sequences" in rows[0].unavailable
    assert "qwen3_5 -> GatedDeltaNet" in str(rows[0])
    assert (
        rows[0].notes["a few tokens of a prompt"]
        == "torch_chunk_gated_delta_rule in segments between them, or the token loop, by cost"
    )
    assert rows[0].notes["a hook on every token"].startswith("chunk-wise blocks")
    # Mamba-1 prompts run in segments too (the library's own scan runs the pieces: Segments.kernel)
    assert rh.support(build("mamba"))[0].notes["a few tokens of a prompt"].endswith("in segments between them")


def test_the_support_command_reads_families_and_saved_configs(tmp_path, capsys):
    from recurrent_hooks.__main__ import main
    from recurrent_hooks.engine.binding.upstream import version_line

    assert main(["support", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {row["family"] for row in rows if row["kind"]} == set(rh.FAMILIES)
    assert any(
        row["mixer_class"] == "ZayaCCAProjection" and row["kind"] == "CompressedConvolutionalAttention" for row in rows
    )
    assert [row for row in rows if row["kind"] is None] == [
        {
            "family": row.family,
            "mixer_class": row.mixer_class,
            "kind": None,
            "works": [],
            "caveats": {},
            "refused": {"everything": {"raises": ["rh.Unavailable"], "why": row.reason}},
        }
        for row in rh_registry.UNSUPPORTED
    ]
    assert any(
        row["mixer_class"] == "Inkling2DynamicShortConvolution" and row["kind"] == "DynamicShortConvolution"
        for row in rows
    )
    assert main(["support", "mamba2"]) == 0
    assert capsys.readouterr().out.startswith(f"{version_line()}\nmamba2: Mamba2Mixer -> Mamba2StateSpace")
    build("jamba").save_pretrained(tmp_path)
    assert main(["support", str(tmp_path / "config.json"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(row["path"], row["kind"]) for row in rows] == [
        ("model.layers.0.mamba", "SelectiveScan"),
        ("model.layers.2.mamba", "SelectiveScan"),
    ]
    assert main(["support", "no_such_family"]) == 2
    assert "is neither a family" in capsys.readouterr().err


def test_support_lists_both_kinds_of_short_convolution_of_a_family():
    """inkling2's dynamic short convolutions (an inline unfold, whose forward the library owns) are listed with their
    own kind, next to its static ones: one family, two kinds."""
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig

    config = Inkling2TextConfig(
        vocab_size=128,
        unpadded_vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        layer_types=["hybrid_sliding", "hybrid"],
        num_attention_heads=2,
        num_key_value_heads=1,
        swa_num_attention_heads=2,
        swa_num_key_value_heads=1,
        head_dim=16,
        swa_head_dim=16,
        sliding_window_size=8,
        d_rel=4,
        rel_extent=16,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_layers_per_attn_res_block=1,
    )
    rows = rh.support(transformers.Inkling2ForCausalLM(config))
    dynamic = [r for r in rows if r.mixer_class == "Inkling2DynamicShortConvolution"]
    assert [r.path for r in dynamic] == [
        "model.layers.1.self_attn.k_proj.sconv",
        "model.layers.1.self_attn.v_proj.sconv",
    ]
    assert all(r.family == "inkling2" and r.kind == "DynamicShortConvolution" for r in dynamic)
    assert {(r.family, r.kind) for r in rows if r not in dynamic} == {("inkling2", "ShortConvolution")}


# -- mixers the library does not handle -------------------------------------------------------------------------------


def test_an_unsupported_model_is_refused_with_the_reason(request):
    """A model without a supported mixer is refused naming the supported families, and the recurrent mixers it has
    that the library does not handle (`UNSUPPORTED`), with their reasons; `support` lists those with the reason.
    (Every recurrent family of transformers 5.24 is supported since zaya: a stand-in row tests the listing.)"""
    with pytest.raises(
        rh.Unavailable,
        match=r"LlamaForCausalLM contains no recurrent mixer of a supported family "
        r"\(supported: qwen3_next, .*, zaya\)$",
    ):
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


def test_every_listed_unsupported_mixer_exists_in_transformers():
    # a loop, not a parametrization: the list may be empty (every recurrent family of transformers 5.24 is supported)
    for row in rh_registry.UNSUPPORTED:
        module = importlib.import_module(f"transformers.models.{row.family}.modeling_{row.family}")
        assert isinstance(getattr(module, row.mixer_class, None), type), f"{row} names no class of {module.__name__}"
