"""Activation patching on recurrent layers: copy the memory after token t from run A into run B.

    python examples/patch_state.py

Run A and run B share their tokens after t. A recurrent layer's memory after t is its state and the
window of its causal convolution. Writing A's memory into B, in every recurrent layer, makes the
recurrent layers continue as in A; what still differs comes from the attention layers, which see
B's tokens <= t through their keys and values.
"""

import torch

import recurrent_hooks as rh
from recurrent_hooks.demo import tiny_model

model = tiny_model()
gen = torch.Generator().manual_seed(0)
run_a = torch.randint(3, 128, (1, 16), generator=gen)
run_b = run_a.clone()
run_b[0, :8] = torch.randint(3, 128, (8,), generator=gen)
t = 7

# 1. Record A: the memory after token t of every recurrent layer, and A's logits.
with rh.watch(model, keep=("states", "windows")) as a, torch.no_grad():
    logits_a = model(run_a).logits
memory = a.memory_after(t)  # {layer: Memory(state, window)}

# 2. Run B with A's memory written after token t.
with rh.watch(model) as b, torch.no_grad():
    b.set_memory_after(t, memory)
    patched = model(run_b).logits
with torch.no_grad():
    logits_b = model(run_b).logits

# 3. Compare: tokens <= t are B's own, later tokens moved towards A.
distance = lambda x: (x[0] - logits_a[0]).norm(dim=-1)  # noqa: E731
print("token   |B - A|   |patched B - A|")
for token, (before, after) in enumerate(zip(distance(logits_b).tolist(), distance(patched).tolist())):
    print(f"{token:5d}  {before:8.4f}  {after:8.4f}{'   <- written after this token' if token == t else ''}")
assert torch.allclose(patched[0, : t + 1], logits_b[0, : t + 1], atol=1e-5), "a write at t changed tokens <= t"
