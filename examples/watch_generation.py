"""Watch and steer the state during generation: a hook at every decode step.

    python examples/watch_generation.py

In `generate`, the prompt is call 0 and decode step k is call k. The hook records the norm of
layer 0's state after the last token of every call; a second hook halves the state at decode step 3.
The state handed to a hook is live: clone it to keep it.
"""

import torch

import recurrent_hooks as rh
from recurrent_hooks.demo import tiny_model

model = tiny_model()
ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(0))
norms = []


def record(mixer, call, token, state):
    norms.append((call, state.flatten(1).norm(dim=-1).tolist()))


def halve(mixer, call, token, state):
    return state * 0.5


# a watch keeps nothing it is not asked for: hooks only, nothing adds up over a long generation
with rh.watch(model) as w, torch.no_grad():
    w.mixers[0].register_state_hook(record, token=-1)
    w.mixers[0].register_state_hook(halve, call=3)
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)

for call, per_row in norms:
    kind = "prompt" if call == 0 else f"decode step {call}"
    print(f"call {call} ({kind}): state norm per batch row {[round(n, 4) for n in per_row]}")
print("kernels:", [c.kernel for c in w.mixers[0].calls])
print("generated:", out[:, 10:].tolist())
