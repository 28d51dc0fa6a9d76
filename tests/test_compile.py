"""torch.compile(model, fullgraph=True) inside a watch: the same outputs, hook calls and kept states as eager.

What is tested is what works today (docs/concepts.md, "torch.compile"): the engine's bookkeeping traces
(no frame inspection, thread lookup, signature binding or storage query while compiling), so a compiled
model runs a watch with hooks, keeps, writes and replacing hooks in one graph. Each call still
recompiles, because the graph's guards read the call records (`len(mixer.calls)`): that limit is pinned
here too, so the test fails (and is to be updated) the day it is lifted. Mamba-1 is the family tested:
its tiny model compiles fastest.
"""

import pytest
import torch

import recurrent_hooks as rh
from _compare import assert_close
from _models import build, random_ids

FAMILY = "mamba"
CALLS = 3


def _run(model, forward, ids):
    seen = []
    with rh.watch(model, keep={"states": [2]}) as w, torch.no_grad():
        w.mixers[0].register_state_hook(lambda m, c, t, s: seen.append((c, t, float(s.norm()))), token=[1, -1])
        w.mixers[-1].register_state_hook(lambda m, c, t, s: s * 0.5, token=3)
        w.mixers[0].set_state_after(5, torch.zeros_like(w.mixers[0].module.A_log[None].expand(1, -1, -1)), call=1)
        logits = [forward(ids).logits for _ in range(CALLS)]
    return logits, seen, w


@pytest.fixture(scope="module")
def runs():
    torch._dynamo.reset()
    model, ids = build(FAMILY), random_ids(1, 8)
    eager = _run(model, model, ids)
    compiled = _run(model, torch.compile(model, fullgraph=True), ids)
    torch._dynamo.reset()
    return eager, compiled


def test_a_compiled_model_in_a_watch_gives_the_eager_outputs_hook_calls_and_states(runs):
    (eager, seen, w), (compiled, compiled_seen, cw) = runs
    for call, (a, b) in enumerate(zip(eager, compiled)):
        assert_close(f"logits of call {call}", a, b, rtol=1e-5, atol=1e-6)
    assert (eager[1] - eager[0]).abs().max() > 1e-4, "the write at call 1 changed nothing"
    assert [hook[:2] for hook in compiled_seen] == [hook[:2] for hook in seen] == \
        [(c, t) for c in range(CALLS) for t in (1, 7)]
    assert_close("hooked state norms", torch.tensor([h[2] for h in seen]), torch.tensor([h[2] for h in compiled_seen]),
                 rtol=1e-5, atol=1e-7)
    assert [c.index for c in cw.mixers[0].calls] == list(range(CALLS))
    for call in range(CALLS):
        assert_close(f"state kept at call {call}", w.mixers[0].state_after(2, call=call),
                     cw.mixers[0].state_after(2, call=call), rtol=1e-5, atol=1e-7)


def test_each_call_still_recompiles():
    """The known limit: the call records are in the graph's guards (issue: compile once)."""
    torch._dynamo.reset()
    model, ids = build(FAMILY), random_ids(1, 8)
    compiled = torch.compile(model, fullgraph=True)
    with rh.watch(model) as w, torch.no_grad():
        w.mixers[0].register_state_hook(lambda m, c, t, s: None)
        compiled(ids)
        with torch._dynamo.config.patch(error_on_recompile=True):
            with pytest.raises(torch._dynamo.exc.RecompileError, match="calls"):
                compiled(ids)
    torch._dynamo.reset()
