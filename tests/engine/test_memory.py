"""The whole memory of every layer, copied from one run into another: the activation-patching identity."""

import pytest
import torch
import transformers
from _compare import assert_close
from _models import build, random_ids

import recurrent_hooks as rh

T, TOKEN = 14, 6


def all_linear_qwen3_5():
    """A qwen3_5 model whose layers are all gated DeltaNet (transformers 5.24 needs use_cache=False for it)."""
    torch.manual_seed(0)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        layer_types=["linear_attention"] * 2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.linear_attn.A_log -= 4.0  # a memory of tens of tokens (see tests/helpers/_models.py)
    return model


MODELS = {
    "mamba": lambda: build("mamba"),
    "falcon_mamba": lambda: build("falcon_mamba"),
    "mamba2": lambda: build("mamba2"),
    "qwen3_5 (all linear)": all_linear_qwen3_5,
}


@pytest.mark.parametrize("name", MODELS)
def test_the_whole_memory_of_every_layer_carries_run_a_into_run_b(name):
    """In a model whose layers are all recurrent, writing run A's memory after token t into run B, which
    shares A's tokens after t, makes B's later logits A's: nothing else carries over from tokens <= t."""
    model = MODELS[name]()
    run_a = random_ids(2, T, seed=1)
    run_b = run_a.clone()
    run_b[:, : TOKEN + 1] = random_ids(2, TOKEN + 1, seed=2)
    with rh.watch(model, keep=("states", "windows")) as a, torch.no_grad():
        logits_a = model(run_a, use_cache=False).logits
    with torch.no_grad():
        logits_b = model(run_b, use_cache=False).logits
    memories = a.memory_after(TOKEN)
    with rh.watch(model) as b, torch.no_grad():
        handles = b.set_memory_after(TOKEN, memories)
        patched = model(run_b, use_cache=False).logits
    assert len(handles) == len(b.mixers) == len(memories)
    assert (logits_b[:, TOKEN + 1 :] - logits_a[:, TOKEN + 1 :]).abs().max() > 1e-4, "the runs did not differ"
    assert_close(
        "B's logits after t, with A's memory", logits_a[:, TOKEN + 1 :], patched[:, TOKEN + 1 :], rtol=1e-4, atol=1e-5
    )
    assert_close("B's logits up to t are B's", logits_b[:, : TOKEN + 1], patched[:, : TOKEN + 1], rtol=1e-5, atol=1e-5)
    # the recurrent states alone do not carry A over: the conv windows hold B's last inputs
    with rh.watch(model) as b, torch.no_grad():
        for mixer in b.mixers:
            mixer.set_state_after(TOKEN, memories[mixer.layer].state)
        states_only = model(run_b, use_cache=False).logits
    assert (states_only[:, TOKEN + 1 :] - logits_a[:, TOKEN + 1 :]).abs().max() > 1e-4


def test_memory_writes_are_checked_and_reported():
    model = build("qwen3_5")
    with rh.watch(model, keep=("states",)) as a:
        model(random_ids(2, T))
    with pytest.raises(rh.Unavailable, match=r"kept no windows; pass keep=\('windows',\)"):
        a.memory_after(3)
    with rh.watch(model) as b:
        with pytest.raises(rh.Unavailable, match=r"no recurrent mixer at layers \[1\]; recurrent layers: \[0, 2\]"):
            b.set_memory_after(3, {1: None})
        with pytest.raises(rh.InvalidValue, match=r"expected a Memory\(state, window\), got Tensor"):
            b.mixers[0].set_memory_after(3, torch.zeros(2))
    with pytest.raises(
        rh.InvalidValue,
        match=r"call 0, token 3: set_window_after\(3, call=0\) gave a window "
        r"with shape \(2, 64\), expected \(2, 64, 4\) \(axes: batch channels kernel_size\)",
    ):
        with rh.watch(model) as b:
            b.mixers[0].set_window_after(3, torch.zeros(2, 64))
            model(random_ids(2, T))
