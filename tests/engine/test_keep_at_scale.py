"""Kept states at real sizes: `watch(reduce=...)` keeps fn(states) a chunk at a time, and
`watch(keep_device=...)` moves kept values as they are kept."""

import pytest
import torch
from _compare import assert_close
from _models import DEVICE, build, random_ids

import recurrent_hooks as rh
from recurrent_hooks.engine.declare.memory_parts import is_parts
from recurrent_hooks.engine.paths import visitor as taking

TOKENS = 150  # more than two chunks of the reduction (taking.Reduction.CHUNK = 64)
# one family per kind: the memory it keeps ("states", or a convolution window only)
KINDS = {
    "qwen3_5": "states",
    "kimi_linear": "states",
    "mamba": "states",
    "zamba": "states",
    "mamba2": "states",
    "recurrent_gemma": "states",
    "rwkv": "states",
    "minimax": "states",
    "lfm2": "windows",
    "xlstm": "states",
    "zaya": "states",
}


def per_token_norm(states):
    """A per-token norm, `[batch, chunk, *state] -> [batch, chunk]` (a state of several parts: one per part; a
    per-head kind's reductions see every head too, as its kept states)."""
    if is_parts(states):
        return torch.stack([part.flatten(2).norm(dim=-1) for part in states], dim=-1)
    return states.flatten(2).norm(dim=-1)


def _full(mixer, name):
    return mixer.states if name == "states" else mixer.windows


def _after(mixer, name, token):
    return mixer.state_after(token) if name == "states" else mixer.window_after(token)


def _at(states, token):
    """states[:, token] of a (maybe several-part) stack."""
    if is_parts(states):
        return type(states)(*(part[:, token] for part in states))
    return states[:, token]


_MODELS = {}


def model_of(family):
    if family not in _MODELS:
        _MODELS[family] = build(family)
    return _MODELS[family]


def kept_whole(model, ids, name="states"):
    """The watch of one forward over `ids` without gradients, keeping every `name` (states or windows) whole."""
    with torch.no_grad(), rh.watch(model, keep=(name,)) as full:
        model(ids, use_cache=False)
    return full


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("family", sorted(KINDS))
def test_a_reduction_is_fn_of_the_kept_states(family, grad):
    model, name, fn = model_of(family), KINDS[family], per_token_norm
    ids = random_ids(2, TOKENS, seed=3)
    seen = []

    def reduce(states):
        seen.append((states[0] if is_parts(states) else states).shape[1])
        return fn(states)

    full = kept_whole(model, ids, name)
    with torch.set_grad_enabled(grad):
        with rh.watch(model, keep=(name,), reduce={name: reduce}) as reduced:
            model(ids, use_cache=False)
    assert seen and max(seen) <= taking.Reduction.CHUNK, seen  # never more than a chunk of states at once
    for whole, mixer in zip(full.mixers, reduced.mixers):
        expected = fn(_full(whole, name))
        got = _full(mixer, name)
        assert_close(f"{family} {mixer}", expected, got.detach(), rtol=1e-4, atol=1e-5)
        assert_close(
            f"{family} {mixer} after 70", expected[:, 70], _after(mixer, name, 70).detach(), rtol=1e-4, atol=1e-5
        )
        assert got.requires_grad == grad, (family, mixer, grad)  # in grad mode the reduction keeps its graph


@pytest.mark.parametrize("family", sorted(KINDS))
def test_a_reduction_at_some_positions(family):
    model, name, fn = model_of(family), KINDS[family], per_token_norm
    ids = random_ids(2, TOKENS, seed=4)
    positions = [3, 70, -1]
    full = kept_whole(model, ids, name)
    with torch.no_grad(), rh.watch(model, keep={name: positions}, reduce={name: fn}) as reduced:
        model(ids, use_cache=False)
    for whole, mixer in zip(full.mixers, reduced.mixers):
        for token in positions:
            expected = fn(_at_keepdim(_full(whole, name), token))[:, 0]
            assert_close(f"{family} {mixer} token {token}", expected, _after(mixer, name, token), rtol=1e-4, atol=1e-5)
        with pytest.raises(rh.Unavailable, match="was not kept"):
            _after(mixer, name, 4)


def _at_keepdim(states, token):
    index = slice(token, token + 1) if token != -1 else slice(-1, None)
    if is_parts(states):
        return type(states)(*(part[:, index] for part in states))
    return states[:, index]


def test_every_state_reduced_runs_chunk_wise_reductions_or_blocks_never_the_states():
    """gated DeltaNet without gradients: every state reduced runs the chunk-wise reductions (the all-states kernel
    handing its chunks to the reduction), or forced, in blocks at any state size (also above the blocks' limit for
    hooks); never the chunk-wise states over the whole call, which hold every state."""
    model = model_of("qwen3_5")
    for paths, path in ((None, "chunk-wise reductions"), (rh.Paths(force="blocks", blocks_below=0), "blocks")):
        with torch.no_grad(), rh.watch(model, keep=("states",), reduce={"states": per_token_norm}, paths=paths) as w:
            model(random_ids(1, TOKENS), use_cache=False)
        assert {part.path for m in w.mixers for part in m.calls[0].kernel_calls} == {path}
    with torch.no_grad(), rh.watch(model, keep=("states",)) as w:
        model(random_ids(1, TOKENS), use_cache=False)
    assert {part.path for m in w.mixers for part in m.calls[0].kernel_calls} == {"chunk-wise states"}


def _kept_bytes(watch):
    total = 0
    for mixer in watch.mixers:
        for call in mixer.calls:
            for memory, parts in call._kept.items():
                seen = set()
                for kept in parts:
                    for value in kept.values():
                        for tensor in value if is_parts(value) else (value,):
                            storage = tensor.untyped_storage()
                            if storage.data_ptr() not in seen:
                                seen.add(storage.data_ptr())
                                total += storage.nbytes()
    return total


@pytest.mark.parametrize("family", ["qwen3_5", "mamba"])
def test_what_a_reduction_holds_does_not_grow_like_the_states(family):
    """After the forward, a watch keeping every state holds T states; one keeping a per-token norm holds T
    numbers per row: 1/state-size of it, whatever T."""
    model = model_of(family)
    held = {}
    for tokens in (64, 256):
        ids = random_ids(1, tokens, seed=5)
        full = kept_whole(model, ids)
        with torch.no_grad(), rh.watch(model, keep=("states",), reduce={"states": per_token_norm}) as reduced:
            model(ids, use_cache=False)
        held[tokens] = (_kept_bytes(full), _kept_bytes(reduced))
        state = full.mixers[0].states[0, 0].numel()
        # a float per token per row, per mixer: the stacked chunks' results
        assert held[tokens][1] <= sum(len(m.calls) for m in reduced.mixers) * tokens * 4 * 2, (held, state)
        assert held[tokens][0] >= state * tokens * 4
    assert held[256][0] >= 3.5 * held[64][0]


def test_keep_device_moves_kept_values_there():
    model = model_of("qwen3_5")
    ids = random_ids(1, 20)
    with torch.no_grad():
        with rh.watch(model, keep=("states", "windows"), keep_device="cpu") as w:
            model(ids, use_cache=False)
        assert w.mixers[0].states.device == torch.device("cpu")
        # "meta" is a device unlike the model's on every machine: the same code as a GPU model kept on the CPU
        for paths in (rh.Paths(), rh.Paths(rule="loop"), rh.Paths(force="segments")):
            with rh.watch(
                model,
                keep={"states": [2, 5]} if paths.force else ("states", "windows"),
                keep_device="meta",
                paths=paths,
            ) as w:
                model(ids, use_cache=False)
            mixer = w.mixers[0]
            assert mixer.state_after(5).device == torch.device("meta"), paths
            if not paths.force:
                assert mixer.states.device == torch.device("meta") and mixer.windows.device.type == "meta"
        with rh.watch(model, keep=("states",), keep_device="meta", reduce={"states": per_token_norm}) as w:
            model(ids, use_cache=False)
        assert w.mixers[0].states.device.type == "meta" and w.mixers[0].states.shape == (1, 20)


def test_keep_device_refuses_a_device_that_is_not_one():
    model = model_of("qwen3_5")
    with pytest.raises(rh.InvalidValue, match=r"watch: keep_device='fake' is not a device this machine has"):
        rh.watch(model, keep=("states",), keep_device="fake")
    with pytest.raises(
        rh.InvalidValue,
        match=r"watch: expected keep_device= a device \(as 'cpu' or 'cuda:0'\) or"
        r" None, got int 3",
    ):
        rh.watch(model, keep=("states",), keep_device=3)


def test_keep_device_with_gradients_refuses_states_and_keeps_the_graph_of_reductions():
    model = model_of("qwen3_5")
    ids = random_ids(1, 12)
    with pytest.raises(
        rh.InvalidValue,
        match=r"call 0, token 0: keep_device='meta' with gradients on: a state"
        rf" kept in grad mode is the tensor the forward read \(on {DEVICE}\)",
    ):
        with rh.watch(model, keep=("states",), keep_device="meta"):
            model(ids, use_cache=False)
    embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    with rh.watch(model, keep=("states",), keep_device="cpu", reduce={"states": per_token_norm}) as w:
        model(inputs_embeds=embeddings, use_cache=False)
    norms = w.mixers[0].states
    assert norms.shape == (1, 12) and norms.requires_grad
    (gradient,) = torch.autograd.grad(norms[:, -1].sum(), embeddings)
    assert gradient.abs().sum() > 0 and gradient[:, -1:].abs().sum() > 0


def test_reductions_are_no_differentiable_states():
    model = model_of("qwen3_5")
    with rh.watch(model, keep=("states",), reduce={"states": per_token_norm}) as w:
        model(random_ids(1, 8), use_cache=False)
    with pytest.raises(
        rh.Unavailable,
        match=r"kept reductions of its states \(watch\(reduce=...\)\), which the"
        r" forward did not read",
    ):
        w.mixers[0].calls[0].differentiable("state")
    assert "state (reduced)" in repr(w.mixers[0].calls[0])


def test_bad_reductions_are_refused_clearly():
    model = model_of("qwen3_5")
    with pytest.raises(rh.InvalidValue, match=r"watch: reduce=\{'states': ...\}, but keep does not keep 'states'"):
        rh.watch(model, keep=("windows",), reduce={"states": per_token_norm})
    with pytest.raises(rh.InvalidValue, match=r"watch: reduce=\{'inputs': ...\}: only kept memories can be reduced"):
        rh.watch(model, keep=("inputs",), reduce={"inputs": per_token_norm})
    with pytest.raises(rh.InvalidValue, match=r"watch: reduce\['states'\] must be a function"):
        rh.watch(model, keep=("states",), reduce={"states": 3})
    with pytest.raises(rh.InvalidValue, match=r"watch: expected reduce= a mapping"):
        rh.watch(model, keep=("states",), reduce=[per_token_norm])
    with pytest.raises(
        rh.InvalidValue,
        match=r"GatedDeltaNet\(qwen3_5, layer 0\), call 0, tokens 0\.\.7: the"
        r" reduction .*returned a tensor of shape \(1,\); expected a tensor"
        r" \[batch, chunk, \.\.\.\] with chunk = 8",
    ):
        with torch.no_grad(), rh.watch(model, keep=("states",), reduce={"states": lambda s: s.flatten(1).norm(dim=1)}):
            model(random_ids(1, 8), use_cache=False)


def test_a_bare_callable_reduces_the_states():
    model = model_of("qwen3_5")
    ids = random_ids(1, 10)
    full = kept_whole(model, ids)
    with torch.no_grad(), rh.watch(model, keep=("states",), reduce=per_token_norm) as reduced:
        model(ids, use_cache=False)
    assert_close("bare callable", per_token_norm(full.mixers[0].states), reduced.mixers[0].states)


class _Remote(torch.Tensor):
    """A tensor as one on an accelerator looks to plots: `.numpy()` refuses it; `.cpu()` / `.to("cpu")` give a
    plain CPU tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.numpy:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu()")
        cpu = func is torch.Tensor.cpu or (
            func is torch.Tensor.to and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device")))
        )
        result = super().__torch_function__(func, types, args, kwargs)
        if cpu and isinstance(result, torch.Tensor):
            return result.as_subclass(torch.Tensor)
        return result


def test_plots_move_tensors_off_the_model_device_before_numpy(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from recurrent_hooks import plots

    matrix = torch.rand(4, 6).as_subclass(_Remote)
    with pytest.raises(TypeError, match="to numpy"):
        matrix.numpy()
    plots.attention_map(matrix).savefig(tmp_path / "map.png")
    plots.sweep_heatmap(matrix).savefig(tmp_path / "sweep.png")

    class Call:
        states = torch.rand(1, 5, 2, 3).as_subclass(_Remote)

    class Mixer:
        layer, calls = 0, [Call()]

    plots.state_norms([Mixer()]).savefig(tmp_path / "norms.png")


def test_the_former_keep_name_in_reduce_warns_and_reduces_the_windows():
    """`reduce={"conv_states": fn}` is the former spelling of `reduce={"windows": fn}` (docs/api.md, "Renamed")."""
    model = model_of("lfm2")
    ids = random_ids(1, 10)
    full = kept_whole(model, ids, "windows")
    with torch.no_grad():
        with pytest.warns(
            rh.RecurrentHooksDeprecationWarning,
            match=r"watch: reduce=\{'conv_states': ...\} is"
            r" renamed reduce=\{'windows': ...\}",
        ):
            reduced = rh.watch(model, keep=("windows",), reduce={"conv_states": per_token_norm})
        with reduced:
            model(ids, use_cache=False)
    assert_close("former name", per_token_norm(full.mixers[0].windows), reduced.mixers[0].windows)


def test_a_reduction_inside_a_compiled_forward():
    """A graph traced by torch.compile keeps the reductions as the eager forward does (`TracedCallTracker.plan`)."""
    model = model_of("qwen3_5")
    ids = random_ids(1, 12, seed=6)
    full = kept_whole(model, ids)
    with torch.no_grad():
        compiled = torch.compile(model, backend="eager")
        with rh.watch(model, keep=("states",), reduce={"states": per_token_norm}) as reduced:
            compiled(ids, use_cache=False)
    for whole, mixer in zip(full.mixers, reduced.mixers):
        assert_close(f"compiled {mixer}", per_token_norm(whole.states), mixer.states, rtol=1e-4, atol=1e-5)
        assert "state (reduced)" in repr(mixer.calls[0])


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_a_checkpointed_recompute_keeps_the_first_forwards_reductions(reentrant):
    """Gradient checkpointing recomputes the call: what is kept is still one reduction per token, equal to the
    eager forward's, and the call is counted once (reentrant: the first forward ran without gradients)."""
    model = model_of("qwen3_5")
    ids = random_ids(1, 12, seed=7)
    full = kept_whole(model, ids)
    model.train()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    try:
        with rh.watch(model, keep=("states",), reduce={"states": per_token_norm}) as reduced:
            model(ids, use_cache=False).logits.square().mean().backward()
    finally:
        model.activation_checkpointing_disable()
        model.eval()
        model.zero_grad(set_to_none=True)
    for whole, mixer in zip(full.mixers, reduced.mixers):
        assert [call.index for call in mixer.calls] == [0]
        assert_close(f"checkpointed {mixer}", per_token_norm(whole.states), mixer.states.detach(), rtol=1e-4, atol=1e-5)
