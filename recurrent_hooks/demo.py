"""A tiny gated DeltaNet model built from a config (nothing is downloaded) and a demo that uses it.

    from recurrent_hooks.demo import tiny_model
    model = tiny_model()          # Qwen3_5ForCausalLM, 4 layers [linear, full, linear, full], random weights

    python -m recurrent_hooks demo    # reads states, patches a state across prompts, steers a generation

The weights are random, so the demo shows mechanics and measurable effects, not meaning. The decay
rates are slowed down (A / 64) so that the random model keeps its state over tens of tokens, as a
trained model does: with transformers' default initialisation most heads forget within a token.
"""

import math

import torch
import transformers

from ._watch import watch

_CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_model(seed: int = 0) -> transformers.Qwen3_5ForCausalLM:
    """A float32 `Qwen3_5ForCausalLM` with two gated DeltaNet layers (0 and 2), random weights, eval mode."""
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**_CONFIG))
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log -= math.log(64)  # slower decay: a memory of tens of tokens
    return model.eval()


def main() -> None:
    """Read, patch and steer the state of the tiny model; print what each step measured."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(0)
    prompt_a = torch.randint(3, 128, (1, 16), generator=gen)
    prompt_b = prompt_a.clone()
    prompt_b[0, :8] = torch.randint(3, 128, (8,), generator=gen)  # B differs from A in its first 8 tokens
    print(f"tiny {type(model).__name__}: {sum(p.numel() for p in model.parameters()):,} parameters, random weights")

    # 1. Read: the state after every token of a prompt, and the convolution window.
    with watch(model, keep=("states", "conv_states", "outputs")) as run_a, torch.no_grad():
        model(prompt_a)
    mixer = run_a.mixers[0]
    print(f"\n1. {mixer}: states {tuple(mixer.states.shape)} (batch, seq, heads, key_dim, value_dim),"
          f" conv windows {tuple(mixer.conv_states.shape)}")
    norms = mixer.states.flatten(2).norm(dim=-1)[0]
    print("   state norm per token:", " ".join(f"{n:.3f}" for n in norms.tolist()))

    # 2. Patch: prompt B shares A's tokens after token 7. Write A's memory after token 7 into the run on
    # B, in every recurrent layer: the state alone, then the whole memory (state and conv window).
    def layer0_output(write=None):
        with watch(model, keep=("outputs",)) as w, torch.no_grad():
            if write is not None:
                write(w)
            model(prompt_b)
        return w.mixers[0].calls[0].output["output"]

    memory = run_a.memory_after(7)
    target = mixer.calls[0].output["output"]
    rows = {
        "unpatched": layer0_output(),
        "state only": layer0_output(lambda w: [m.set_state_after(7, memory[m.layer].state) for m in w.mixers]),
        "whole memory": layer0_output(lambda w: w.set_memory_after(7, memory)),
    }
    print(f"\n2. patch A's memory after token 7 into the run on B (tokens 8.. are shared);")
    print(f"   distance of {mixer}'s kernel output to A's, tokens 8..15:")
    for name, out in rows.items():
        print(f"   {name:>12}:", " ".join(f"{d:.1e}" for d in (out - target)[0, 8:].flatten(1).norm(dim=-1).tolist()))
    print("   the state alone leaves B's last inputs in the convolution window; the whole memory carries A over")

    # 3. Steer and watch a generation: scale the state at decode step 2, record every step's norm.
    trace = []
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with watch(model) as w, torch.no_grad():
        w.mixers[0].register_state_hook(lambda m, call, token, s: trace.append((call, s.norm().item())), token=-1)
        w.mixers[0].register_state_hook(lambda m, call, token, s: s * 4.0, call=2)
        steered = model.generate(prompt_a, **kwargs)
    with torch.no_grad():
        plain = model.generate(prompt_a, **kwargs)
    print("\n3. generate 6 tokens; layer 0's state scaled by 4 after decode step 2:")
    print("   last-token state norm seen by the first hook:", ", ".join(f"call {c}: {n:.3f}" for c, n in trace))
    change = [(a - b).abs().max().item() for a, b in zip(plain.logits, steered.logits)]
    print("   max |logit change| per call:", ", ".join(f"{c:.1e}" for c in change))

    # 4. Gradient of the last token's log-partition with respect to a state.
    with watch(model, keep=("states",)) as w:
        metric = model(prompt_a).logits[0, -1].logsumexp(-1)
    (grad,) = torch.autograd.grad(metric, w.mixers[1].state_after(7))
    print(f"\n4. |d logsumexp(logits[-1]) / d state after token 7| in {w.mixers[1]}: {grad.norm():.4e}")
