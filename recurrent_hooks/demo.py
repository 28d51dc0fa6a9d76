"""A tiny gated DeltaNet model built from a config (nothing is downloaded) and a demo that uses it.

    from recurrent_hooks.demo import tiny_model
    model = tiny_model()          # Qwen3_5ForCausalLM, 4 layers [linear, full, linear, full], random weights

    python -m recurrent_hooks demo    # on the trained Mamba-2 toy: read, patch, steer, attribute

`tiny_model`'s weights are random, so it shows mechanics and measurable effects, not meaning (the demo
itself runs on a trained toy of `recurrent_hooks.toys`). The decay
rates are slowed down (A / 64) so that the random model keeps its state over tens of tokens, as a
trained model does: with transformers' default initialisation most heads forget within a token.
"""

import math

import torch
import transformers

from .engine.watch import watch

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
    """Read, patch, steer and attribute the memory of the shipped Mamba-2 MQAR toy; print what each step measured."""
    from .studies.attribution import attribute
    from .toys import MQAR, generate_answers, load_toy

    task, model = MQAR(), load_toy("mamba2")
    names = {t: f"k{t - task.key_tokens.start}" for t in task.key_tokens}
    names |= {t: f"v{t - task.value_tokens.start}" for t in task.value_tokens}
    print(
        f"{type(model).__name__} trained on multi-query associative recall (recurrent_hooks.toys, no download):"
        f" {sum(p.numel() for p in model.parameters()):,} parameters, {task.num_pairs} key-value pairs, then"
        f" {task.num_queries} queries"
    )

    # 1. Read: the state after every token of a prompt.
    clean, corrupt = task.contrast(1, seed=7)
    query = int(task.answer_positions[-1])
    pair = int(clean.query_pairs[0, -1])
    value = int(task.value_positions[pair])
    right, wrong = int(clean.answers[0, -1]), int(corrupt.answers[0, -1])
    clean_ids, corrupt_ids = clean.ids[:, : query + 1], corrupt.ids[:, : query + 1]
    with watch(model, keep=("states", "windows")) as run, torch.no_grad():
        logits = model(clean_ids).logits
    mixer = run.mixers[0]
    print(f"\n1. prompt: {' '.join(names.get(int(t), 'bos') for t in clean_ids[0])}")
    print(f"   {mixer}: states {tuple(mixer.states.shape)} (batch, seq, heads, head_dim, d_state)")
    print("   state norm per token:", " ".join(f"{n:.1f}" for n in mixer.states.flatten(2).norm(dim=-1)[0].tolist()))
    print(
        f"   the last query asks for k{int(clean.pair_keys[0, pair]) - task.key_tokens.start}: answer"
        f" {names[int(logits[0, query].argmax())]} (right: {names[right]})"
    )

    # 2. Patch: the corrupt prompt changes that pair's value; write the clean memory after the value token.
    def answer(write=None):
        with watch(model) as w, torch.no_grad():
            if write is not None:
                write(w)
            logits = model(corrupt_ids).logits[0, query]
        return names[int(logits.argmax())], float(logits[right] - logits[wrong])

    memory = run.memory_after(value)
    rows = {
        "unpatched": answer(),
        "state only": answer(lambda w: [m.set_state_after(value, memory[m.layer].state) for m in w.mixers]),
        "whole memory": answer(lambda w: w.set_memory_after(value, memory)),
    }
    print(
        f"\n2. patch: the corrupt prompt gives pair {pair} the value {names[wrong]}; write the clean run's memory"
        f" after token {value} (the value) into it, in every layer:"
    )
    for name, (token, margin) in rows.items():
        print(f"   {name:>12}: answer {token}, logit({names[right]}) - logit({names[wrong]}) = {margin:+.2f}")
    print("   right after the value token, only the convolution window holds it: the state alone does nothing")

    # 3. Steer a generation: the same write, in the prompt of a generate over the cache.
    with watch(model) as w, torch.no_grad():
        w.set_memory_after(value, memory)
        steered = generate_answers(model, task, corrupt)
    plain = generate_answers(model, task, corrupt)
    print("\n3. generate the four answers of the corrupt prompt (one decode step each):")
    print("   plain:  ", " ".join(names[int(t)] for t in plain[0]))
    print("   written:", " ".join(names[int(t)] for t in steered[0]), "(the last answer follows the written memory)")

    # 4. Attribution: the effect of patching every layer x token, from one backward.
    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[:, query, right] - logits[:, query, wrong]

    result = attribute(model, clean_ids[0], corrupt_ids[0], metric)  # one pair, [seq]: [layers, seq]
    layer, token = divmod(int(result.memory.argmax()), result.memory.shape[1])
    print(
        f"\n4. attribution from one backward: the largest estimated effect is layer {result.layers[layer]},"
        f" after token {token}; no token before the value ({value}) matters:"
        f" max |estimate| there {result.memory[:, :value].abs().max():.1e}"
    )
