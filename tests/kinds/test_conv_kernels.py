"""The convolution token loops against transformers' own pure-torch kernels, and windows against their definition."""

import pytest
import torch
from _compare import assert_close
from _contract import one_family_per_kind
from _upstream import transformers_kernel

import recurrent_hooks as rh
from recurrent_hooks.extend import CONV_KERNELS
from recurrent_hooks.kinds.shared.conv import causal_conv1d_fn, causal_conv1d_update

# one module per kind whose modules call the shared conv kernels
MODULES = one_family_per_kind(lambda kind: {k.name for k in CONV_KERNELS} <= {k.name for k in kind.KERNELS})


def hf(family, name):
    return transformers_kernel(family, name)


def inputs(batch=2, channels=6, length=9, size=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(batch, channels, length, generator=gen),
        torch.randn(channels, size, generator=gen),
        torch.randn(channels, generator=gen),
    )


@pytest.mark.parametrize("family", MODULES)
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("length", [1, 3, 9], ids=lambda n: f"L{n}")
def test_loops_equal_transformers_kernels(family, activation, length):
    x, weight, bias = inputs(length=length)
    assert_close(
        "prompt output",
        hf(family, "causal_conv1d_fn")(x, weight, bias, activation),
        causal_conv1d_fn(x, weight, bias, activation),
        rtol=1e-6,
        atol=1e-6,
    )
    state = torch.randn(2, 6, 4)
    theirs, ours = state.clone(), state.clone()
    step = x[..., :1]
    assert_close(
        "decode output",
        hf(family, "causal_conv1d_update")(step, theirs, weight, bias, activation),
        causal_conv1d_update(step, ours, weight, bias, activation),
        rtol=1e-6,
        atol=1e-6,
    )
    assert_close("decode window, written in place", theirs, ours, rtol=0, atol=0)


@pytest.mark.parametrize("prefix", [0, 4], ids=["fresh", "cached-window"])
def test_windows_are_the_last_inputs_and_a_replacement_feeds_only_later_tokens(prefix):
    x, weight, bias = inputs(length=prefix + 7)
    seen = []
    out = causal_conv1d_fn(x, weight, bias, tokens=7, on_token=lambda t, w: seen.append(w) or w)
    padded = torch.nn.functional.pad(x, (4, 0))
    for t, window in enumerate(seen):
        p = prefix + t
        assert_close(f"window after token {t}", padded[..., p + 1 : p + 5], window, rtol=0, atol=0)
    replacement = torch.randn(2, 6, 4)
    patched = causal_conv1d_fn(x, weight, bias, tokens=7, on_token=lambda t, w: replacement if t == 2 else w)
    assert_close("outputs up to the write", out[..., : prefix + 3], patched[..., : prefix + 3], rtol=0, atol=0)
    # token 3 reads the written window's last 3 columns and its own input
    window = torch.cat([replacement[..., 1:], x[..., prefix + 3, None]], dim=-1)
    assert_close(
        "token 3 after the write", (window * weight).sum(-1) + bias, patched[..., prefix + 3], rtol=1e-6, atol=1e-6
    )
    assert_close("token 6 is back to its own inputs", out[..., prefix + 6], patched[..., prefix + 6], rtol=0, atol=0)


def test_decode_replacement_is_written_into_the_cache_tensor():
    x, weight, bias = inputs(length=1)
    state = torch.randn(2, 6, 4)
    replacement = torch.randn(2, 6, 4)
    out = causal_conv1d_update(x, state, weight, bias, on_token=lambda t, w: replacement)
    assert_close("cache window", replacement, state, rtol=0, atol=0)
    assert out.shape == (2, 6, 1)


def test_window_terms_equal_the_effect_of_writing_each_window():
    """conv.window_terms(x - x', g, w)[p]: sum over the later positions s of g_s times the change of the
    convolution's output at s when the window after p is x's instead of x''s (linear: the exact change)."""
    from recurrent_hooks.kinds.shared.conv import window_terms

    gen = torch.Generator().manual_seed(5)
    batch, channels, length, size = 2, 3, 9, 4
    x, x_other = torch.randn(2, batch, channels, length, generator=gen, dtype=torch.float64)
    grad = torch.randn(batch, channels, length, generator=gen, dtype=torch.float64)
    weight = torch.randn(channels, size, generator=gen, dtype=torch.float64)
    padded = torch.nn.functional.pad
    expected = torch.zeros(batch, length, dtype=torch.float64)
    for p in range(length):
        # the primed run's inputs, with the window after p (inputs p-K+1..p) taken from x
        written = x_other.clone()
        lo = max(0, p - size + 1)
        written[..., lo : p + 1] = x[..., lo : p + 1]
        for s in range(p + 1, min(length, p + size)):
            inputs = lambda v: padded(v, (size - 1, 0))[..., s : s + size]  # noqa: E731  window_s, oldest first
            window = inputs(x_other).clone()
            window[..., : size - (s - p)] = inputs(written)[..., : size - (s - p)]  # the columns read from W_p
            change = ((window - inputs(x_other)) * weight).sum(-1)  # b c
            expected[:, p] += (grad[..., s] * change).sum(-1)
    got = window_terms(x - x_other, grad, weight)
    assert_close("window terms", got, expected.float(), rtol=1e-5, atol=1e-6)


def test_the_loop_refuses_packed_sequences():
    """A packed batch (`seq_idx`) keeps its sequences apart in transformers' kernel (with causal_conv1d); the
    library's loop runs one sequence per batch row, so a call it runs (hooks, writes, kept windows) is refused."""
    x, weight = torch.randn(1, 4, 6), torch.randn(4, 3)
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 1]], dtype=torch.int32)
    with pytest.raises(rh.RecurrentHooksError, match=r"packed sequences \(seq_idx\) need the causal_conv1d package"):
        causal_conv1d_fn(x, weight, on_token=lambda t, window: window, seq_idx=seq_idx)
