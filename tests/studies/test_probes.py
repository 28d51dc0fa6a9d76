"""`rh.probe(a, b)`: rank-r linear readouts of every token's state per head, kept as a reduction, equal to the
float64 einsum over the token loop's states, per kind; one probe per layer; bad factors and states refused."""

import pytest
import torch
from _compare import assert_close
from _models import build, random_ids

import recurrent_hooks as rh

T = 9
# gated DeltaNet, KDA, Mamba-2, Mamba-1 (no heads axis), Mamba-1 run once per head (zamba: the probe sees every head,
# its factors sized to the kept states' heads; tests/engine/test_per_head_reductions.py)
FAMILIES = ["qwen3_5", "kimi_linear", "mamba2", "mamba", "zamba"]


def _states(model, ids, paths=None):
    with torch.no_grad(), rh.watch(model, keep=("states",), paths=paths) as w:
        model(ids)
    return {m.layer: m.states for m in w.mixers}


def _factors(state, rank, seed):
    """Factors for a state `[batch, seq, (heads,) rows, cols]` (a state without heads is one head)."""
    heads, rows, cols = (1, *state.shape[2:]) if state.dim() == 4 else tuple(state.shape[2:])
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(heads, rank, rows, generator=gen), torch.randn(heads, rank, cols, generator=gen)


def _reference(state, a, b):
    state = state.double().unsqueeze(2) if state.dim() == 4 else state.double()
    return torch.einsum("bthij,hki,hkj->bthk", state, a.double(), b.double())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_probe_equals_the_einsum_over_the_token_loops_states(family):
    model, ids = build(family), random_ids(2, T)
    loop = _states(model, ids, paths=rh.Paths(rule="loop"))
    probes = {layer: rh.probe(*_factors(state, rank=3, seed=layer)) for layer, state in loop.items()}
    for paths in (rh.Paths(rule="loop"), None):  # the token loop; the default path (chunk-wise where the kind has it)
        with torch.no_grad(), rh.watch(model, keep=("states",), reduce={"states": probes}, paths=paths) as w:
            model(ids)
        for mixer in w.mixers:
            expected = _reference(loop[mixer.layer], probes[mixer.layer].a, probes[mixer.layer].b)
            got = mixer.states
            assert got.shape == expected.shape and got.dtype == torch.float32
            scale = expected.abs().max()
            assert_close(
                f"{mixer} probe ({'loop' if paths else 'default path'})",
                expected,
                got.double(),
                rtol=1e-5,
                atol=1e-6 * scale,
            )


def test_one_probe_per_layer_and_layers_without_one_keep_their_states():
    model, ids = build("qwen3_5"), random_ids(1, T)
    states = _states(model, ids)
    first, *others = sorted(states)
    a, b = _factors(states[first], rank=2, seed=0)
    with torch.no_grad(), rh.watch(model, keep=("states",), reduce={"states": {first: rh.probe(a, b)}}) as w:
        model(ids)
    assert_close(
        "the probed layer", _reference(states[first], a, b), w.mixer(first).states.double(), rtol=1e-5, atol=1e-7
    )
    for layer in others:
        assert w.mixer(layer).states.shape == states[layer].shape
        assert_close(f"layer {layer} kept its states", states[layer], w.mixer(layer).states, rtol=1e-5, atol=1e-8)


def test_bad_factors_and_states_are_refused():
    with pytest.raises(
        rh.InvalidValue,
        match=r"rh.probe: expected a as a float tensor \[heads, r, rows\], got a"
        r" torch.int64 tensor of shape \(2, 3\)",
    ):
        rh.probe(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, 4))
    with pytest.raises(rh.InvalidValue, match=r"with the same heads and rank, got a \(4, 2, 8\) and b \(4, 3, 8\)"):
        rh.probe(torch.ones(4, 2, 8), torch.ones(4, 3, 8))
    model, ids = build("qwen3_5"), random_ids(1, T)
    wrong = rh.probe(torch.ones(4, 2, 5), torch.ones(4, 2, 8))
    with pytest.raises(
        rh.InvalidValue,
        match=r"rh.probe\(a \[4, 2, 5\], b \[4, 2, 8\]\): expected states \[batch,"
        r" chunk, 4, 5, 8\] \(heads, rows, cols of the factors\), got \(1, 9, 4, 8, 8\)",
    ) as error:
        with torch.no_grad(), rh.watch(model, keep=("states",), reduce={"states": wrong}):
            model(ids)
    assert any("the reduction" in note for note in getattr(error.value, "__notes__", [])), error.value
    with pytest.raises(
        rh.InvalidValue,
        match=r"reduce\['states'\] as a mapping must map layers \(ints\) to"
        r" functions",
    ):
        rh.watch(model, keep=("states",), reduce={"states": {"0": wrong}})


def _wide(family):
    """The family's test model with states wide enough that a rank-2 probe's readouts cost less than the states
    (rank x 16 < 2 cols: `Segments.readouts`; cols = value_dim, or Mamba-2's d_state)."""
    import _models
    import transformers

    torch.manual_seed(0)
    if family == "qwen3_5":
        model = _models._lengthen_memory(
            _models._make(
                transformers.Qwen3_5TextConfig,
                transformers.Qwen3_5ForCausalLM,
                **_models._COMMON,
                **_models._ATTENTION,
                **{**_models._GDN, "linear_value_head_dim": 24},
                intermediate_size=64,
                layer_types=list(_models._HYBRID_LAYERS),
            )
        )
    elif family == "mamba2":
        model = _models._make(
            transformers.Mamba2Config,
            transformers.Mamba2ForCausalLM,
            **_models._TWO_LAYERS,
            num_heads=4,
            head_dim=16,
            expand=2,
            state_size=24,
            n_groups=2,
            conv_kernel=4,
            chunk_size=8,
        )
    else:
        model = _models._make(
            transformers.KimiLinearConfig,
            transformers.KimiLinearForCausalLM,
            **_models._COMMON,
            **_models._MLA,
            **_models._KDA_MOE,
            **{**_models._KDA, "linear_head_dim": 24},
            intermediate_size=64,
            layer_types=list(_models._HYBRID_LAYERS),
            mlp_layer_types=["dense", "sparse"] * 2,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            num_local_experts=4,
        )
    return model.float().eval()


@pytest.mark.parametrize("family", ["qwen3_5", "kimi_linear", "mamba2"])
def test_the_chunk_wise_kernels_form_a_probes_readouts_without_the_states(family, monkeypatch):
    """Without gradients, the delta rules' and SSD's chunk-wise kernels form a low-rank probe's readouts itself
    (`Segments.readouts`): the probe is never called on states, and the readouts equal the float64 einsum over the
    token loop's states. A probe of higher rank runs on the states."""
    model, ids = _wide(family), random_ids(2, 37)  # (37: two full 16-token chunks and a partial one)
    loop = _states(model, ids, paths=rh.Paths(rule="loop"))
    low = {layer: rh.probe(*_factors(state, rank=2, seed=layer)) for layer, state in loop.items()}
    called = []
    monkeypatch.setattr(
        rh.studies.probes.Probe,
        "__call__",
        lambda self, states: called.append(self) or _reference(states, self.a, self.b).float(),
    )
    with torch.no_grad(), rh.watch(model, keep=("states",), reduce={"states": low}) as w:
        model(ids)
    assert not called
    for mixer in w.mixers:
        assert mixer.calls[0].kernel_calls[0].path == "chunk-wise reductions"
        expected = _reference(loop[mixer.layer], low[mixer.layer].a, low[mixer.layer].b)
        assert_close(f"{mixer} readouts", expected, mixer.states.double(), rtol=1e-4, atol=1e-5 * expected.abs().max())
    high = {layer: rh.probe(*_factors(state, rank=3, seed=layer)) for layer, state in loop.items()}  # 3 x 16 >= 48
    with torch.no_grad(), rh.watch(model, keep=("states",), reduce={"states": high}) as w:
        model(ids)
    assert len(called) == 2 * 3  # per layer, one call per 16-token chunk
