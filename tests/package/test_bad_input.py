"""Bad input to the public API, on qwen3_5, is refused with an error that says where and what was expected: a
written state of the wrong shape, dtype or device, a hook that returns something else, a token or a call that is not
an int or lies outside what ran, a read of what was not kept (`Unavailable`), and bad arguments to `watch`, `support`,
`route_kernels` and the handles' writes and hooks; a refused write leaves no kernel rebound. Integer 0-d tensors count
as ints."""

import pytest
import torch
from _compare import assert_close, assert_equal
from _models import DEVICE, build, random_ids
from _qwen3_5 import T, bindings, run

import recurrent_hooks as rh
import recurrent_hooks.engine.binding.rebinding as rh_patching


@pytest.fixture
def model():
    return build("qwen3_5")


@pytest.fixture
def watched():
    model = build("qwen3_5")
    with rh.watch(model, keep=("states",)) as w, torch.no_grad():
        model(random_ids(2, T))
    return w


# -- writes and hooks -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (lambda s: torch.zeros(2, 4, 8), r"shape \(2, 4, 8\), expected \(2, 4, 8, 8\)"),
        (lambda s: torch.zeros_like(s, dtype=torch.float64), r"dtype torch.float64, expected torch.float32"),
        (lambda s: torch.zeros_like(s, device="meta"), rf"device meta, expected {DEVICE}"),
    ],
    ids=["shape", "dtype", "device"],
)
def test_a_written_state_that_does_not_fit_is_refused(model, value, message):
    with rh.watch(model, keep=("states",)) as w:
        run(model)
        state = w.mixers[0].state_after(3)
    before = bindings()
    with pytest.raises(
        rh.InvalidValue,
        match=r"GatedDeltaNet\(qwen3_5, layer 0\), call 0, token 3: "
        r"set_state_after\(3, call=0\) gave a state with " + message,
    ):
        with rh.watch(model) as w:
            w.mixers[0].set_state_after(3, value(state))
            run(model)
    assert bindings() == before


def test_a_hook_returning_something_else_is_refused(model):
    with pytest.raises(rh.InvalidValue, match=r"layer 2\), call 0, token 4: state hook .* returned str"):
        with rh.watch(model) as w:
            w.mixers[1].register_state_hook(lambda m, c, t, s: "no", token=4)
            run(model)


def test_set_state_after_refuses_non_tensors_and_bad_calls(model):
    with rh.watch(model) as w:
        with pytest.raises(rh.InvalidValue, match="expected a Tensor with axes"):
            w.mixers[0].set_state_after(3, [[0.0]])
        with pytest.raises(rh.InvalidValue, match="calls count from 0, got call=-1"):
            w.mixers[0].set_state_after(3, torch.zeros(1), call=-1)
        with pytest.raises(rh.InvalidValue, match="expected a callable"):
            w.mixers[0].register_state_hook(None)
        with pytest.raises(rh.InvalidValue, match="token must be an int"):
            w.mixers[0].register_state_hook(lambda *a: None, token="last")


def test_a_token_outside_the_call_is_refused(model):
    with pytest.raises(
        rh.InvalidValue,
        match=r"layer 0\): set_state_after\(13, call=0\) targets token 13, but call 0 "
        r"\(torch_chunk_gated_delta_rule\) has 13 tokens \(valid: 0..12 or -13..-1\)",
    ):
        with rh.watch(model) as w:
            w.mixers[0].set_state_after(T, torch.zeros(2, 4, 8, 8))
            run(model)


@pytest.mark.parametrize(
    ("call", "kwargs", "message"),
    [
        (
            lambda m, s: m.set_state_after(True, s),
            {},
            r"set_state_after\(True, call=0\): token must be an int, got the bool",
        ),
        (lambda m, s: m.set_state_after(4.0, s), {}, r"token must be an int, got float 4.0"),
        (lambda m, s: m.set_state_after(4, s, call=1.0), {}, r"call must be an int, got float 1.0"),
        (lambda m, s: m.set_state_after(4, s, call=slice(-1, None)), {}, r"a slice of calls needs start >= 0"),
        (
            lambda m, s: m.register_state_hook(lambda *a: None, token=4.0),
            {},
            r"register_state_hook: token must be an int",
        ),
        (lambda m, s: m.register_state_hook(lambda *a: None, call=[0, True]), {}, r"call must be an int, got the bool"),
        (
            lambda m, s: m.register_state_hook(lambda *a: None, call=range(3, 3)),
            {},
            r"call=range\(3, 3\) targets no call",
        ),
        (lambda m, s: m.set_memory_after(4, s), {}, r"expected a Memory\(state, window\), got Tensor"),
    ],
    ids=[
        "bool token",
        "float token",
        "float call",
        "negative slice",
        "hook float token",
        "bool call",
        "empty range",
        "memory not a pair",
    ],
)
def test_writes_and_hooks_refuse_bad_arguments(call, kwargs, message):
    model = build("qwen3_5")
    with rh.watch(model) as w:
        with pytest.raises(rh.InvalidValue, match=message):
            call(w.mixers[0], torch.zeros(2, 4, 8, 8))


# -- reads ------------------------------------------------------------------------------------------------------------


def test_reading_what_was_not_kept_or_does_not_exist(model):
    with rh.watch(model) as w:
        run(model)
    mixer = w.mixers[0]
    with pytest.raises(
        rh.Unavailable,
        match=r"GatedDeltaNet\(qwen3_5, layer 0\): call 0 kept no states; "
        r"pass keep=\('states',\) to watch",
    ):
        mixer.states
    with rh.watch(model, keep=("states",)) as w:
        run(model)
    with pytest.raises(rh.Unavailable, match=r"token 13 is outside call 0, which has 13 tokens"):
        w.mixers[0].state_after(T)
    with pytest.raises(rh.Unavailable, match=r"no call 1; this watch saw 1 calls"):
        w.mixers[0].state_after(0, call=1)
    assert_close("negative token", w.mixers[0].state_after(T - 1), w.mixers[0].state_after(-1), rtol=0, atol=0)
    with rh.watch(model) as w:
        with pytest.raises(rh.Unavailable, match="has not been called inside this watch yet"):
            w.mixers[0].states
        with pytest.raises(rh.Unavailable, match=r"no recurrent mixer at layer 1; recurrent layers: \[0, 2\]"):
            w.mixer(1)
    assert w.mixer(2) is w.mixers[1]


@pytest.mark.parametrize("token", [True, 4.0, "4", torch.tensor([4]), torch.tensor(4.0), None], ids=repr)
def test_reads_refuse_tokens_that_are_not_ints(watched, token):
    with pytest.raises(rh.InvalidValue, match=r"GatedDeltaNet\(qwen3_5, layer 0\)\.state_after: token must be an int"):
        watched.mixers[0].state_after(token)


def test_integer_0d_tensors_work_as_ints(watched):
    mixer = watched.mixers[0]
    assert_equal("state after tensor(4)", mixer.state_after(4), mixer.state_after(torch.tensor(4)))
    assert_equal("call tensor(0)", mixer.state_after(4), mixer.state_after(4, call=torch.tensor(0)))


# -- the entry points -------------------------------------------------------------------------------------------------


def test_entry_points_refuse_bad_arguments():
    model = build("qwen3_5")
    with pytest.raises(rh.InvalidValue, match=r"watch: expected record=True or record=False, got record='no'"):
        rh.watch(model, record="no")
    with pytest.raises(rh.InvalidValue, match=r"watch: expected keep as a tuple of names or a mapping"):
        rh.watch(model, keep=5)
    with pytest.raises(rh.InvalidValue, match=r"watch: keep\['states'\] must be an int"):
        rh.watch(model, keep={"states": [1.5]})
    with pytest.raises(rh.InvalidValue, match=r"support: expected a torch.nn.Module \(a transformers model\), got str"):
        rh.support("hello")
    with pytest.raises(
        rh.InvalidValue,
        match=r"route_kernels: expected to= one of 'torch', 'default', 'recurrent',"
        r" 'chunked' for qwen3_5 \(GatedDeltaNet\), got 'fast'",
    ):
        rh.route_kernels("qwen3_5", "fast")
    with rh.watch(model) as w:
        with pytest.raises(rh.InvalidValue, match=r"Watch.mixer: layer must be an int, got the bool True"):
            w.mixer(True)
        with pytest.raises(rh.InvalidValue, match=r"set_memory_after: expected a mapping of layer -> Memory"):
            w.set_memory_after(3, [1])
    assert not rh_patching._BINDINGS
