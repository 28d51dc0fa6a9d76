"""Kernel tests for Kimi delta attention: the library's token loops against transformers and the float64 reference.

- The two loops (`chunk_kimi_delta_attention`, `recurrent_kimi_delta_attention`) against the kernels of
  every KDA family's modeling module (transformers' pure-torch kernel, behind its hub wrapper:
  `recurrent_hooks.extend.torch_kernel`): outputs and final states, float32 and bf16 inputs.
- The state handed to `on_token` at every token against `kimi_delta_rule_reference` (float64).
- `on_token` replacement: a state replaced at token t changes nothing up to t, and tokens t+1.. (and the
  final state) continue from the replacement.

Shapes: batch 2, heads 4, key_dim 8, value_dim 16; lengths 1, 37 and 70 (transformers' chunk size is 64).
"""

import pytest
import torch
import torch.nn.functional as F
from _compare import assert_close
from _reference import kimi_delta_rule_reference
from _upstream import transformers_kernel

from recurrent_hooks import FAMILIES, KimiDeltaAttention
from recurrent_hooks.kinds.kimi_delta import (
    chunk_kimi_delta_attention,
    chunk_kimi_delta_attention_states,
    recurrent_kimi_delta_attention,
)
from recurrent_hooks.kinds.shared import delta_rule

KDA_FAMILIES = [name for name, row in FAMILIES.items() if row.kind is KimiDeltaAttention]
LOOPS = {"chunk": chunk_kimi_delta_attention, "recurrent": recurrent_kimi_delta_attention}
KERNEL_NAMES = {
    "chunk": KimiDeltaAttention.kernel_for("prompt").name,
    "recurrent": KimiDeltaAttention.kernel_for("decode").name,
}
LENGTHS = [1, 37, 70]
BATCH, HEADS, KEY_DIM, VALUE_DIM = 2, 4, 8, 16

# float32 loop vs transformers' float32 kernels; values are O(1), errors measured up to ~1.5e-6.
FP32 = dict(rtol=1e-5, atol=1e-5)


def _inputs(seq: int, gate: str, seed: int = 0, normalized: bool = True) -> dict:
    """Random kernel inputs; `gate` "softplus" is kimi_linear's form of g, "safe" the bounded one of the other two."""
    gen = torch.Generator().manual_seed(seed)
    shape = (BATCH, seq, HEADS, KEY_DIM)
    logits = torch.randn(shape, generator=gen)
    g = -F.softplus(logits) if gate == "softplus" else -5.0 * torch.sigmoid(logits)
    # Without the in-kernel L2 norm, keys must be short for the delta rule to stay stable (|k| ~ 1).
    scale = 1.0 if normalized else KEY_DIM**-0.5
    return dict(
        query=torch.randn(shape, generator=gen) * scale,
        key=torch.randn(shape, generator=gen) * scale,
        value=torch.randn(BATCH, seq, HEADS, VALUE_DIM, generator=gen),
        g=g,
        beta=torch.rand(BATCH, seq, HEADS, generator=gen),
        initial_state=torch.randn(BATCH, HEADS, KEY_DIM, VALUE_DIM, generator=gen),
    )


def _transformers_kernel(family: str, which: str):
    """transformers' own torch kernel, by the library's rule (`torch_kernel`)."""
    return transformers_kernel(family, KERNEL_NAMES[which])


def _call(fn, which: str, x: dict, **extra):
    """Call a kernel (ours or transformers') the way the KDA mixers do, by keyword after q, k, v."""
    kwargs = dict(
        g=x["g"],
        beta=x["beta"],
        initial_state=x["initial_state"],
        output_final_state=True,
        use_qk_l2norm_in_kernel=x.get("normalized", True),
    )
    kwargs.update(extra)
    if which == "chunk":
        kwargs["chunk_size"] = 64
    return fn(x["query"], x["key"], x["value"], **kwargs)


def _recorder(states: list):
    def on_token(t: int, state: torch.Tensor) -> torch.Tensor:
        states.append(state.clone())
        return state

    return on_token


@pytest.mark.parametrize("gate", ["softplus", "safe"])
@pytest.mark.parametrize("seq", LENGTHS, ids=lambda T: f"T{T}")
@pytest.mark.parametrize("which", list(LOOPS))
@pytest.mark.parametrize("family", KDA_FAMILIES)
def test_loop_matches_transformers_kernel(family, which, seq, gate):
    x = _inputs(seq, gate)
    want_out, want_state = _call(_transformers_kernel(family, which), which, x)
    out, state = _call(LOOPS[which], which, x)
    assert out.dtype == want_out.dtype and state.dtype == want_state.dtype == torch.float32
    assert_close(f"{family} {which} output", want_out, out, **FP32)
    assert_close(f"{family} {which} final state", want_state, state, **FP32)


@pytest.mark.parametrize("which", list(LOOPS))
@pytest.mark.parametrize("family", KDA_FAMILIES)
def test_loop_from_zeros_without_final_state(family, which):
    x = dict(_inputs(37, "safe"), initial_state=None)
    want_out, want_state = _call(_transformers_kernel(family, which), which, x, output_final_state=False)
    out, state = _call(LOOPS[which], which, x, output_final_state=False)
    assert want_state is None and state is None
    assert_close(f"{family} {which} output from zeros", want_out, out, **FP32)


@pytest.mark.parametrize("inputs", ["g-bf16", "all-bf16"])
@pytest.mark.parametrize("which", list(LOOPS))
def test_loop_bf16_inputs_match_transformers_kernel(which, inputs):
    """bailing_hybrid hands g over in the model dtype; both sides compute in float32 and return a float32 state."""
    x = _inputs(37, "safe")
    names = ["g"] if inputs == "g-bf16" else ["query", "key", "value", "g", "beta"]
    x.update({name: x[name].to(torch.bfloat16) for name in names})
    want_out, want_state = _call(_transformers_kernel("bailing_hybrid", which), which, x)
    out, state = _call(LOOPS[which], which, x)
    assert out.dtype == want_out.dtype == x["query"].dtype
    assert state.dtype == want_state.dtype == torch.float32
    # bf16 outputs: one rounding of a float32 result, so allow a bf16 ulp (2 ** -8 relative).
    tol = FP32 if out.dtype == torch.float32 else dict(rtol=2**-7, atol=1e-5)
    assert_close(f"bailing_hybrid {which} output ({inputs})", want_out, out, **tol)
    assert_close(f"bailing_hybrid {which} final state ({inputs})", want_state, state, **FP32)


@pytest.mark.parametrize("normalized", [True, False], ids=["l2norm", "raw-qk"])
@pytest.mark.parametrize("seq", LENGTHS, ids=lambda T: f"T{T}")
@pytest.mark.parametrize("which", list(LOOPS))
def test_per_token_states_match_reference(which, seq, normalized):
    x = dict(_inputs(seq, "softplus", seed=1, normalized=normalized), normalized=normalized)
    want_out, want_states = kimi_delta_rule_reference(
        x["query"], x["key"], x["value"], x["g"], x["beta"], initial_state=x["initial_state"], normalize_qk=normalized
    )
    states = []
    out, final = _call(LOOPS[which], which, x, on_token=_recorder(states))
    assert len(states) == seq
    assert_close(f"{which} outputs vs reference", want_out, out, **FP32)
    assert_close(f"{which} per-token states vs reference", want_states, torch.stack(states, dim=1), **FP32)
    assert_close(f"{which} final state vs last per-token state", states[-1], final, rtol=0, atol=0)


@pytest.mark.parametrize("token", [0, 10, 36], ids=lambda t: f"at{t}")
@pytest.mark.parametrize("which", list(LOOPS))
def test_on_token_replacement_changes_only_later_tokens(which, token):
    x = _inputs(37, "safe", seed=2)
    replacement = torch.randn(BATCH, HEADS, KEY_DIM, VALUE_DIM, generator=torch.Generator().manual_seed(3))

    def replace(t: int, state: torch.Tensor) -> torch.Tensor:
        return replacement if t == token else state

    plain_out, _ = _call(LOOPS[which], which, x)
    out, final = _call(LOOPS[which], which, x, on_token=replace)
    assert_close(
        f"{which} outputs up to the replaced token {token}",
        plain_out[:, : token + 1],
        out[:, : token + 1],
        rtol=0,
        atol=0,
    )
    later = {name: value[:, token + 1 :] for name, value in x.items() if name != "initial_state"}
    want_out, want_states = kimi_delta_rule_reference(
        later["query"], later["key"], later["value"], later["g"], later["beta"], initial_state=replacement
    )
    assert_close(f"{which} outputs after token {token}", want_out, out[:, token + 1 :], **FP32)
    want_final = replacement if token == 36 else want_states[:, -1]
    assert_close(f"{which} final state after a replacement at token {token}", want_final, final, **FP32)


def test_recurrent_single_token_replacement_is_the_final_state():
    """A decode call (one token): the replaced state is what the cache receives."""
    x = _inputs(1, "softplus", seed=4)
    replacement = torch.zeros(BATCH, HEADS, KEY_DIM, VALUE_DIM)
    plain_out, _ = _call(recurrent_kimi_delta_attention, "recurrent", x)
    out, final = _call(recurrent_kimi_delta_attention, "recurrent", x, on_token=lambda t, s: replacement)
    assert_close("decode output (computed before the replacement)", plain_out, out, rtol=0, atol=0)
    assert_close("decode final state", replacement, final, rtol=0, atol=0)


@pytest.mark.parametrize("gate", ["softplus", "safe"])
@pytest.mark.parametrize("seq", LENGTHS, ids=lambda T: f"T{T}")
@pytest.mark.parametrize("row_steps_from", [10**9, 0], ids=["product", "row-steps"])
def test_chunkwise_states_match_reference(seq, gate, row_steps_from, monkeypatch):
    """The chunk-wise all-states path (every state kept, per-channel decay) against the float64 recurrence, with a
    chunk's states formed at once and token by token (`ROW_STEPS_FROM`)."""
    monkeypatch.setattr(delta_rule, "ROW_STEPS_FROM", row_steps_from)
    x = _inputs(seq, gate, seed=2)
    want_out, want_states = kimi_delta_rule_reference(
        x["query"], x["key"], x["value"], x["g"], x["beta"], initial_state=x["initial_state"], normalize_qk=True
    )
    (out, final), states = _call(chunk_kimi_delta_attention_states, "chunk", x)
    assert_close("outputs vs reference", want_out, out, **FP32)
    assert_close("every state vs reference", want_states, states.movedim(0, 1), **FP32)
    assert_close("final state", want_states[:, -1], final, **FP32)
