"""The bytes each busy path holds, measured at real layer dims against the model the path choice uses
(`memory.held_bytes`, `rh.Paths(memory_budget=...)`).

One layer of each kind whose prompt kernel declares a cost shape (gated DeltaNet at Qwen3.5 dims, Kimi delta
attention at Kimi-Linear dims and Mamba-2 at mamba2-130m dims), watched with the path forced (with `--full`:
.ci/run runs them after the default suite). What a
path holds is measured as the peak of the live bytes of every storage allocated during the forward (a
`TorchDispatchMode`, so on any device) less the unwatched forward's peak and the kept states; it must stay within
the model, and where the model grows with the call (the token loop's and the pieces' graphs under autograd) within
1.6 x the measurement plus 8 states. Then the budget at work, on declared shapes: with gradients and 128 stops in
2,048 tokens the token loop's graph is over a 2 GiB budget and the call takes segments; every state kept on another
device is not held all at once over the budget; below every path, the one holding least; a forced path ignores the
budget; the default is a quarter of the device's memory; bad budgets are refused; and through a watched model.
"""

import gc
import math
import weakref
from types import SimpleNamespace

import pytest
import torch
import transformers
from _compare import assert_close
from _models import VOCAB, build, random_ids
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import recurrent_hooks as rh
import recurrent_hooks.engine.paths.budget as rh_memory
import recurrent_hooks.engine.paths.choose as rh_choose
from recurrent_hooks.engine.policy import Strategy
from recurrent_hooks.kinds.gated_delta_net import GatedDeltaNet

STOPS = 16


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages allocated inside the mode that are alive (`live`), and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.alive: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.alive.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if id(storage) not in self.alive and storage.nbytes() > 0:
                    self.alive.add(id(storage))
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
        return out


def _qwen3_5():
    return transformers.Qwen3_5ForCausalLM(
        transformers.Qwen3_5TextConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=256,
            num_hidden_layers=1,
            layer_types=["linear_attention"],
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
        )
    )


def _kimi_linear():
    return transformers.KimiLinearForCausalLM(
        transformers.KimiLinearConfig(
            vocab_size=VOCAB,
            hidden_size=256,
            intermediate_size=256,
            num_hidden_layers=1,
            layer_types=["linear_attention"],
            mlp_layer_types=["dense"],
            num_attention_heads=2,
            num_key_value_heads=2,
            kv_lora_rank=16,
            v_head_dim=16,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            q_lora_rank=None,
            linear_head_dim=128,
            linear_num_heads=32,
            linear_conv_kernel_dim=4,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
    )


def _mamba2():
    return transformers.Mamba2ForCausalLM(
        transformers.Mamba2Config(
            vocab_size=VOCAB,
            hidden_size=768,
            num_heads=24,
            head_dim=64,
            expand=2,
            state_size=128,
            n_groups=1,
            chunk_size=256,
            conv_kernel=4,
            num_hidden_layers=1,
        )
    )


# a model of one layer, its state's elements, the tokens of its prompt (Mamba-2: one chunk of 256)
MODELS = {
    "gated DeltaNet, Qwen3.5 dims": (_qwen3_5, 32 * 128 * 128, 64),
    "Kimi delta attention, Kimi-Linear dims": (_kimi_linear, 32 * 128 * 128, 64),
    "Mamba-2, mamba2-130m dims": (_mamba2, 24 * 64 * 128, 256),
}


@pytest.fixture(scope="module", params=list(MODELS))
def layer(request):
    build, elements, tokens = MODELS[request.param]
    torch.manual_seed(0)
    return request.param, build().eval(), 4 * elements, tokens


def _peak(model, ids, grad: bool, **watched) -> tuple[int, str | None]:
    """The peak live bytes of a forward (watched as `watched` says, if anything), and the path its call took."""
    setup = watched.pop("setup", None)
    gc.collect()
    with torch.set_grad_enabled(grad):
        if not watched and setup is None:
            with LiveBytes() as live:
                out = model(ids, use_cache=False).logits
            return live.peak, None
        with rh.watch(model, **watched) as w:
            if setup is not None:
                setup(w.mixers[0])
            with LiveBytes() as live:
                out = model(ids, use_cache=False).logits
        del out
        return live.peak, w.mixers[0].calls[0].kernel_calls[0].path


def _held(model, ids, grad: bool, stops: list[int], **kept) -> dict[Strategy, float]:
    """The model's bytes for each path of this layer's prompt call (`held_bytes` of the shape its kind declares
    from the call's own arguments)."""
    with torch.no_grad(), rh.watch(model, keep=("inputs",)) as w:
        model(ids, use_cache=False)
    mixer, call = w.mixers[0], w.mixers[0].calls[0]
    shape = type(mixer).kernel_for("prompt").segments.shape(call.inputs)
    return rh_memory.held_bytes(shape, ids.shape[1], stops, grad, **kept)


def _spread(tokens: int) -> list[int]:
    return [int((i + 0.5) * tokens / STOPS) for i in range(STOPS)]


def _hook(tokens):
    return lambda mixer: mixer.register_state_hook(lambda *args: None, token=tokens)


REDUCE = {"keep": ("states",), "reduce": lambda states: states.flatten(2).norm(dim=-1)}
# name: (path, gradients, what the watch is asked on a prompt of T tokens, the states it keeps as they are,
# the tokens the call stops at, whether it reduces every state)
CASES = {
    "token loop, every state kept, gradients": (
        Strategy.LOOP,
        True,
        lambda t: {"keep": ("states",)},
        lambda t: t,
        range,
        False,
    ),
    "token loop, a hook at 16 tokens, gradients": (
        Strategy.LOOP,
        True,
        lambda t: {"setup": _hook(_spread(t))},
        lambda t: 0,
        _spread,
        False,
    ),
    "segments, a hook at 16 tokens, gradients": (
        Strategy.SEGMENTS,
        True,
        lambda t: {"setup": _hook(_spread(t))},
        lambda t: 0,
        _spread,
        False,
    ),
    "segments, 16 states kept": (
        Strategy.SEGMENTS,
        False,
        lambda t: {"keep": {"states": _spread(t)}},
        lambda t: STOPS,
        _spread,
        False,
    ),
    "token loop, 16 states kept": (
        Strategy.LOOP,
        False,
        lambda t: {"keep": {"states": _spread(t)}},
        lambda t: STOPS,
        _spread,
        False,
    ),
    "chunk-wise states, every state kept": (
        Strategy.STATES,
        False,
        lambda t: {"keep": ("states",)},
        lambda t: t,
        lambda t: [],
        False,
    ),
    "blocks, a hook at every token": (
        Strategy.BLOCKS,
        False,
        lambda t: {"setup": _hook(None)},
        lambda t: 0,
        lambda t: [],
        False,
    ),
    "blocks, a reduction of every state": (Strategy.BLOCKS, False, lambda t: REDUCE, lambda t: 0, lambda t: [], True),
    "token loop, a reduction of every state": (Strategy.LOOP, False, lambda t: REDUCE, lambda t: 0, lambda t: [], True),
    "chunk-wise reductions": (Strategy.CHUNKS, False, lambda t: REDUCE, lambda t: 0, lambda t: [], True),
}
GROWS = {
    "token loop, every state kept, gradients",
    "token loop, a hook at 16 tokens, gradients",
    "segments, a hook at 16 tokens, gradients",
}  # the model grows with the call: checked to be tight too


@pytest.mark.full  # (about 1 s a case at these dims: run with --full, which .ci/run runs after the default suite)
@pytest.mark.parametrize("case", list(CASES))
def test_each_path_holds_at_most_what_the_model_says(layer, case):
    name, model, state, tokens = layer
    path, grad, asked, kept, stops, reducing = CASES[case]
    ids = torch.randint(3, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
    force = rh.Paths(rule="loop") if path is Strategy.LOOP else rh.Paths(force=path, blocks_below=1 << 40)
    plain, _ = _peak(model, ids, grad)
    peak, taken = _peak(model, ids, grad, paths=force, **asked(tokens))
    assert taken == path.label, f"{name}, {case}: the forced path was not taken: {taken!r}"
    modelled = _held(model, ids, grad, list(stops(tokens)), kept=kept(tokens), reducing=reducing)[path]
    measured = peak - plain - kept(tokens) * state
    where = (
        f"{name}, {case}: measured {measured / 2**20:.1f} MiB ({measured / state:.1f} states) beyond the"
        f" unwatched forward's peak {plain / 2**20:.1f} MiB, modelled {modelled / 2**20:.1f} MiB"
        f" ({modelled / state:.1f} states)"
    )
    assert measured <= modelled, where
    if case in GROWS:
        assert modelled <= 1.6 * max(measured, 0) + 8 * state, where


# -- the budget at work ------------------------------------------------------------------------------------------


def _meta(*shape: int) -> torch.Tensor:
    return torch.zeros(()).expand(*shape)


def _gdn_arguments(batch: int, tokens: int) -> dict:
    """A gated DeltaNet prompt call's arguments at Qwen3.5 dims (16 key / 32 value heads of 128): shapes only."""
    return {
        "query": _meta(batch, tokens, 16, 128),
        "key": _meta(batch, tokens, 16, 128),
        "value": _meta(batch, tokens, 32, 128),
        "g": _meta(batch, tokens, 32),
        "beta": _meta(batch, tokens, 32),
    }


def _plan(hooks=(), keep=None, device=None):
    return SimpleNamespace(hooks=list(hooks), keep=keep, kind=GatedDeltaNet, device=device)


GDN = GatedDeltaNet.kernel_for("prompt")


def _choose(plan, tokens: int, grad: bool, **paths) -> Strategy:
    choice = rh_choose.choose(GDN, [plan], tokens, _gdn_arguments(1, tokens), grad=grad, paths=rh.Paths(**paths))
    return Strategy.LOOP if choice is None else choice.path


def test_over_the_budget_the_token_loop_gives_way_to_segments_with_gradients():
    """128 stops in 2,048 tokens with gradients: the cost model takes the token loop, whose graph holds about 2
    states a token (8.0 GiB here); a budget of 2 GiB takes segments (a padded chunk's graph a piece, 1.4 GiB)."""
    tokens, stops = 2048, frozenset(range(8, 2048, 16))
    plan = _plan(hooks=[(None, stops)])
    shape = GDN.segments.shape(_gdn_arguments(1, tokens))
    held = rh_memory.held_bytes(shape, tokens, stops, grad=True)
    assert held[Strategy.SEGMENTS] < 2**31 < held[Strategy.LOOP], held
    assert _choose(plan, tokens, True, memory_budget=math.inf) is Strategy.LOOP
    assert _choose(plan, tokens, True, memory_budget=2**31) is Strategy.SEGMENTS
    assert _choose(plan, tokens, True, memory_budget=0) is Strategy.SEGMENTS  # none fits: the one holding least
    assert _choose(plan, tokens, False, memory_budget=2**31) is Strategy.LOOP  # no graph without gradients


def test_states_kept_on_another_device_are_not_held_all_at_once_over_the_budget():
    """Every state kept on another device (`keep_device`) without gradients: the chunk-wise states path holds
    them all on the call's device until the call is over (T states: 1 GiB here), the token loop one at a time."""
    tokens = 512
    plan = _plan(keep=frozenset(range(tokens)), device=torch.device("meta"))
    assert _choose(plan, tokens, False, rule="fixed", memory_budget=math.inf) is Strategy.STATES
    assert _choose(plan, tokens, False, rule="fixed", memory_budget=2**29) is Strategy.LOOP
    kept_here = _plan(keep=frozenset(range(tokens)))  # kept on the call's device: no path holds them for long
    assert _choose(kept_here, tokens, False, rule="fixed", memory_budget=2**29) is Strategy.STATES


def test_a_forced_path_ignores_the_budget():
    plan = _plan(hooks=[(None, frozenset(range(8, 2048, 16)))])
    assert _choose(plan, 2048, True, force="segments", memory_budget=0) is Strategy.SEGMENTS


def test_the_default_budget_is_a_quarter_of_the_devices_memory():
    cpu = torch.device("cpu")
    assert rh_memory.budget_of(rh.Paths(), cpu) == rh_memory.DEFAULT_BUDGET_SHARE * rh_memory.device_memory(cpu)
    assert 0 < rh_memory.device_memory(cpu) < math.inf
    assert rh_memory.budget_of(rh.Paths(memory_budget=5), cpu) == 5


@pytest.mark.parametrize("bad", [-1, "1GB", True, float("nan")])
def test_a_bad_budget_is_refused(bad):
    with pytest.raises(rh.InvalidValue, match="memory_budget="):
        rh.Paths(memory_budget=bad)


def test_a_numpy_number_is_taken_as_the_python_number_it_is():
    """`rh.Paths(memory_budget=np.int64(5))` was refused where np.float64(5.0) was taken."""
    numpy = pytest.importorskip("numpy")  # (matplotlib, in the test extra, brings it)
    for budget, kept in ((numpy.int64(5), 5), (numpy.float64(5.5), 5.5), (numpy.int32(0), 0)):
        paths = rh.Paths(memory_budget=budget)
        assert paths.memory_budget == kept and type(paths.memory_budget) is type(kept)
    assert type(rh.Paths(loop_threads=numpy.int64(2)).loop_threads) is int
    with pytest.raises(rh.InvalidValue, match="memory_budget="):
        rh.Paths(memory_budget=numpy.bool_(True))


def test_a_watched_forward_takes_the_path_within_its_budget():
    """Through a model (the test dims, hooks at 6 tokens, gradients): the fixed rule takes segments, whose pieces'
    graphs (a padded 64-token chunk each) hold more than the token loop's graph at these dims: with a budget of 0
    bytes the call takes the loop (the least), with the same outputs, hook inputs and gradients."""
    model = build("qwen3_5")
    ids = random_ids(2, 24)
    results = {}
    for name, budget in {"no limit": math.inf, "0 bytes": 0}.items():
        seen = []
        model.zero_grad()
        with rh.watch(model, paths=rh.Paths(rule="fixed", memory_budget=budget)) as w:
            w.mixers[0].register_state_hook(
                lambda mixer, call, token, state: seen.append(state.detach().clone()),
                call=0,
                token=list(range(0, 24, 4)),
            )
            logits = model(ids).logits
            path = w.mixers[0].calls[0].kernel_calls[0].path
        logits.square().mean().backward()
        results[name] = (path, logits.detach(), torch.stack(seen), model.model.embed_tokens.weight.grad.clone())
    assert (results["no limit"][0], results["0 bytes"][0]) == (Strategy.SEGMENTS.label, Strategy.LOOP.label)
    for what, expected, got in zip(
        ("logits", "hook inputs", "gradient"), results["no limit"][1:], results["0 bytes"][1:]
    ):
        assert_close(what, expected, got, rtol=1e-5, atol=1e-6)
