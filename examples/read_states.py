"""Read the state of every recurrent layer after every token of a prompt.

    python examples/read_states.py

Replace `tiny_model()` by your own model (any supported family); nothing else changes.
"""

import torch

import recurrent_hooks as rh
from recurrent_hooks.demo import tiny_model

model = tiny_model()
ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))

with rh.watch(model, keep=("states", "inputs")) as w, torch.no_grad():
    model(ids)

for mixer in w.mixers:
    states = mixer.states  # [batch, seq, heads, key_dim, value_dim]
    norms = states.flatten(2).norm(dim=-1)[0]
    print(f"{mixer}: states {tuple(states.shape)}, kernel {mixer.calls[0].kernel}")
    print("  norm after each token:", " ".join(f"{n:.3f}" for n in norms.tolist()))
    # what the state stores under the last key of head 0: S^T k
    key = mixer.calls[0].inputs["key"][0, -1, 0]
    key = key / key.norm()
    readout = mixer.state_after(-1)[0, 0].T @ key  # [value_dim]
    print("  read-out of the last key, head 0:", " ".join(f"{x:+.4f}" for x in readout[:4].tolist()), "...")
