"""The window channels that feed each head, written from the models' layouts (transformers' modeling code, the
papers), not from the library's declarations: gated DeltaNet and Kimi delta attention convolve `[q | k | v]` (value
head j reads key head j // (heads // key_heads)), Mamba-2 convolves `[x | B | C]` (head h reads B/C group h //
(heads // groups)), zamba convolves the heads' x channels."""

import torch


def feeding(family, model, layer, head, state_shape, channels):
    """The window channels head `head` reads, from the model's layout (not from the library's declaration)."""
    heads = state_shape[1]
    if family in ("qwen3_5", "kimi_linear"):
        key_dim, value_dim = state_shape[2], state_shape[3]
        key_heads = model.config.linear_num_key_heads if family == "qwen3_5" else heads
        key_head = head // (heads // key_heads)
        q = list(range(key_head * key_dim, (key_head + 1) * key_dim))
        return (
            q
            + [c + key_heads * key_dim for c in q]
            + list(range(2 * key_heads * key_dim + head * value_dim, 2 * key_heads * key_dim + (head + 1) * value_dim))
        )
    if family == "mamba2":
        head_dim, d_state, groups = state_shape[2], state_shape[3], model.config.n_groups
        group, x = head // (heads // groups), heads * head_dim
        b = list(range(x + group * d_state, x + (group + 1) * d_state))
        return list(range(head * head_dim, (head + 1) * head_dim)) + b + [c + groups * d_state for c in b]
    if family == "zamba":
        head_dim = channels // heads
        return list(range(head * head_dim, (head + 1) * head_dim))
    raise AssertionError(f"no window layout for {family}")


def shares(family, model, state_shape, channels):
    """`[channels, heads]`: channel c's term split equally among the heads it feeds (what attribution's per-head
    window rows sum)."""
    heads = state_shape[1]
    out = torch.zeros(channels, heads)
    for head in range(heads):
        out[feeding(family, model, 0, head, state_shape, channels), head] = 1.0
    return out / out.sum(1, keepdim=True)
