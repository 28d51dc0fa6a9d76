"""The mLSTM of xLSTM (matrix memory, exponential gating): the `MatrixLSTM` mixer kind and its token loop.

Glossary (code name, symbol in Beck et al., "xLSTM: Extended Long Short-Term Memory", 2024, and
"xLSTM 7B", 2025, shape as transformers' `xLSTMBackend` hands it to its kernel):
    batch      b                                  batch size
    seq        t (a position), T (the length)     tokens of one kernel call
    heads      -                                  heads (`num_heads`), each with its own memory
    key_dim    d_qk (`qk_head_dim`)               query/key head size
    value_dim  d_v (`v_head_dim`)                 value head size
    one        -                                  an axis of size 1 (transformers keeps m_t as `[batch, heads, 1]`)
    query      q_t    [batch, heads, seq, key_dim]     head-major, as the kernel takes it; q̂_t = q_t / √d_qk
    key        k_t    [batch, heads, seq, key_dim]     not scaled
    value      v_t    [batch, heads, seq, value_dim]
    igate      ĩ_t    [batch, heads, seq]   input gate preactivation, soft-capped: 15 tanh(x / 15) (`gate_soft_cap`)
    fgate      f̃_t    [batch, heads, seq]   forget gate preactivation, soft-capped alike; log f_t = log σ(f̃_t)
    state      MLSTMState(C, n, m), a `typing.NamedTuple` of three float32 tensors (a memory of named parts):
      C        C_t    [batch, heads, key_dim, value_dim]   matrix memory, key-major (h̃_t reads C_tᵀ q̂_t)
      n        n_t    [batch, heads, key_dim]              normalizer
      m        m_t    [batch, heads, one]                  stabilizer (a running max of log gates)

Recurrence, per head, in the stabilized form transformers computes (C, n are e^{-m_t} times the paper's
unstabilized memory and normalizer, so (C, n, m) is one value: its three parts only make sense together):
    m_t  = max(log σ(f̃_t) + m_{t-1}, ĩ_t)
    i'_t = exp(ĩ_t - m_t),  f'_t = exp(log σ(f̃_t) + m_{t-1} - m_t)
    C_t  = f'_t C_{t-1} + i'_t k_t v_tᵀ
    n_t  = f'_t n_{t-1} + i'_t k_t
    h̃_t  = C_tᵀ q̂_t / (max(|n_tᵀ q̂_t|, exp(-m_t)) + ε)
The layer around it (the output gate σ(W_o x), the multi-head layer norm, the projections) is outside the memory.

transformers runs one function for prompts and decode steps, `xLSTMBackend._inference_fn`, a
`functools.partial` of `wrap_chunkwise_arbitrary_sequence_length` built in `xLSTMBackend.__init__`: a
prompt goes chunk-wise (`mlstm_chunkwise_native_autograd`) over ⌊T/chunk⌋·chunk tokens and token by token
(`mlstm_recurrent_sequence_native`) over the rest; one token goes through `mlstm_recurrent_step_native`.
The token loop here is that step, with its operations in its order and dtypes (the state in
`inference_state_dtype`, float32; the reads in the inputs' dtype), so that it equals transformers' step and
sequence kernels bit for bit; its chunk-wise part, which computes in the inputs' dtype, within float rounding.

Module contents:
- `MLSTMState`: the state, a NamedTuple (C, n, m).
- `mlstm_inference`: the token loop, with the call signature of `_inference_fn` plus `on_token`.
- `mlstm_train`: the token loop of `_train_fn` (config.mode "train" / "train_with_padding").
- `MatrixLSTM`: the mixer kind, its kernels, state and values declared as class constants, after its adapter
  (`MatrixLSTMAdapter`).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from ..engine.declare.kernels import Kernel, Role, Site
from ..engine.declare.limits import Caveat, Refused
from ..engine.errors import RecurrentHooksError, Unavailable
from ..engine.handle.adapter import KindAdapter
from ..engine.handle.mixer import RecurrentMixer
from ..engine.tracing import compiling
from ..engine.tracking.records import KernelCall


class MLSTMState(NamedTuple):
    """The memory of one mLSTM layer: matrix memory C_t, normalizer n_t, stabilizer m_t (float32)."""

    C: Float[Tensor, "batch heads key_dim value_dim"]
    n: Float[Tensor, "batch heads key_dim"]
    m: Float[Tensor, "batch heads one"]


OnToken = Callable[[int, MLSTMState], MLSTMState]  # `loops.OnToken`, for this state type


def mlstm_inference(
    *,
    query: Float[Tensor, "batch heads seq key_dim"],
    key: Float[Tensor, "batch heads seq key_dim"],
    value: Float[Tensor, "batch heads seq value_dim"],
    igate: Float[Tensor, "batch heads seq"],
    fgate: Float[Tensor, "batch heads seq"],
    c_initial: Float[Tensor, "batch heads key_dim value_dim"] | None = None,
    n_initial: Float[Tensor, "batch heads key_dim"] | None = None,
    m_initial: Float[Tensor, "batch heads one"] | None = None,
    on_token: OnToken | None = None,
    original: Any = None,
) -> tuple[Float[Tensor, "batch heads seq value_dim"], tuple[Tensor, Tensor, Tensor]]:
    """`xLSTMBackend._inference_fn` token by token: same arguments and results, plus `on_token`.

        out, (C, n, m) = mlstm_inference(query=q, key=k, value=v, igate=i, fgate=f, on_token=hook)

    Returns `(h, (C, n, m))`, h `[batch, heads, seq, value_dim]` in the inputs' dtype, the last state in
    float32. `on_token(t, MLSTMState(C, n, m))` is called after each token's update and returns the state
    token t+1 continues from. `original` is the partial bound before the watch: its ε (`config.eps`) and
    state dtype (`config.inference_state_dtype`) are used.
    """
    if query.shape[2] < 1:
        raise ValueError(
            f"Received empty sequence (sequence_length={query.shape[2]}), require at least single"
            " element in the sequence."
        )
    eps, dtype_state = _settings(original)
    state = _initial(query, value, c_initial, n_initial, m_initial)
    h, last = _mlstm(query, key, value, igate, fgate, state, eps, dtype_state, on_token)
    return h, tuple(last)


def mlstm_train(
    *,
    query: Float[Tensor, "batch heads seq key_dim"],
    key: Float[Tensor, "batch heads seq key_dim"],
    value: Float[Tensor, "batch heads seq value_dim"],
    igate: Float[Tensor, "batch heads seq"],
    fgate: Float[Tensor, "batch heads seq"],
    c_initial: Tensor | None = None,
    n_initial: Tensor | None = None,
    m_initial: Tensor | None = None,
    return_last_states: bool = False,
    on_token: OnToken | None = None,
    original: Any = None,
) -> Tensor | tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """`xLSTMBackend._train_fn` (config.mode "train", "train_with_padding") token by token, plus `on_token`.

    transformers' train kernel is the chunk-wise one alone: it requires seq to be a multiple of
    `chunk_size` ("train"), or pads with zeros to one and refuses `return_last_states` ("train_with_padding");
    the loop keeps both rules. It computes in float32 (the chunk-wise kernel in the inputs' dtype).
    """
    keywords = getattr(original, "keywords", None) or {}
    padded = "mlstm_chunkwise_kernel" in keywords  # wrap_chunkwise_pad_zeros around the chunk-wise kernel
    inner = getattr(keywords.get("mlstm_chunkwise_kernel"), "keywords", None) or {} if padded else keywords
    chunk_size, eps = inner.get("chunk_size", 64), inner.get("eps", 1e-6)
    seq = query.shape[2]
    if padded and return_last_states:
        raise ValueError(
            "We are padding zeros, so we cannot return last states, as they would be not the true last states."
        )
    if not padded and seq % chunk_size != 0:
        raise ValueError(f"Sequence length {seq} is not divisible by chunk size {chunk_size}.")
    state = _initial(query, value, c_initial, n_initial, m_initial)
    h, last = _mlstm(query, key, value, igate, fgate, state, eps, torch.float32, on_token)
    return (h, tuple(last)) if return_last_states else h


class MatrixLSTMAdapter(KindAdapter):
    """xLSTM's adapter: a forward's freshness read from the layer's cached (C, n, m), and its values."""

    def parse_forward(self, module: nn.Module, arguments: dict[str, Any]) -> tuple[int, Any, bool, Tensor]:
        """`xLSTMLayer.forward(x, state)`: the state is the layer's cached (C, n, m), not a cache object;
        a call is fresh when there is none or it is all zeros (a prompt: `xLSTMCache` starts from zeros)."""
        hidden, state = arguments[self.kind.FORWARD_INPUT], arguments.get("state")
        if state is None:
            fresh = True
        else:  # under torch.compile, a value of the graph (see `compiled.begin`)
            zeros = torch.stack([part.detach().any() for part in state]).any().logical_not()
            fresh = zeros if compiling() else bool(zeros)
        return hidden.shape[1], None, fresh, hidden

    def token_values(self, mixer: RecurrentMixer, kernel_call: KernelCall) -> dict[str, Tensor]:
        x = kernel_call.inputs
        token_major = {name: x[name].transpose(1, 2) for name in ("query", "key", "value", "igate", "fgate")}
        return {**token_major, "output": kernel_call.output["output"].transpose(1, 2)}


class MatrixLSTM(RecurrentMixer):
    """An mLSTM mixer (xlstm: `xLSTMLayer`).

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            model(input_ids)
        w.mixers[0].states.C   # Float[Tensor, "batch seq heads key_dim value_dim"]; .n, .m likewise

    The state is `MLSTMState(C, n, m)` (see the module glossary), float32: hooks get and return one,
    `state_after(t)` is one, `set_state_after(t, MLSTMState(...))` writes one, `states` stacks each part
    over tokens. The kernel is an instance attribute, `mlstm_backend._inference_fn` (a `functools.partial`
    captured when the model was built), rebound per mixer module for the watch; it serves prompts and
    decode steps alike. The mixer has no convolution window.
    """

    STATE_TYPE = MLSTMState
    ADAPTER = MatrixLSTMAdapter
    KERNELS = (
        Kernel(
            name="_inference_fn",
            role=Role.BOTH,
            loop=mlstm_inference,
            site=Site.INSTANCE,
            state_in=("c_initial", "n_initial", "m_initial"),
            results=("output", "final_state"),
            seq=("value", 2),
        ),
        Kernel(
            name="_train_fn",
            role=Role.PROMPT,
            loop=mlstm_train,
            site=Site.INSTANCE,
            state_in=("c_initial", "n_initial", "m_initial"),
            results=("output", "final_state"),
            seq=("value", 2),
        ),
    )
    MEMORIES = ("state",)
    LEFT_PADDING = "enters"  # xLSTM's forward takes no attention mask (LIMITS)
    STATE = {"C": "batch heads key_dim value_dim", "n": "batch heads key_dim", "m": "batch heads one"}
    HEADS = True  # axis 1 of C, n and m
    INPUTS = {
        "query": "batch heads seq key_dim",
        "key": "batch heads seq key_dim",
        "value": "batch heads seq value_dim",
        "igate": "batch heads seq",
        "fgate": "batch heads seq",
        "c_initial": "batch heads key_dim value_dim",
        "n_initial": "batch heads key_dim",
        "m_initial": "batch heads one",
    }
    OUTPUTS = {"output": "batch heads seq value_dim"}
    VALUES = {
        "query": "batch seq heads key_dim",
        "key": "batch seq heads key_dim",
        "value": "batch seq heads value_dim",
        "igate": "batch seq heads",
        "fgate": "batch seq heads",
        "output": "batch seq heads value_dim",
    }
    FORWARD_INPUT = "x"
    LIMITS = {
        "segments": Caveat(
            "the kernel takes its state as three arguments: a few kept tokens run the token loop, not transformers'"
            " kernel in segments"
        ),
        "bf16 / fp16": Caveat(
            "transformers' chunk-wise kernel computes a prompt's first chunk_size-multiple tokens in the model dtype,"
            " the token loop in float32 (as its step and sequence kernels do): a watched half-precision prompt's"
            " logits move by up to transformers' own prompt-versus-token-by-token difference (tested within twice"
            " it); decode steps and prompts shorter than chunk_size are bit-identical. Without a cache, transformers'"
            " kernel fails on a half-precision prompt of >= chunk_size tokens (float32 zero state against"
            " model-dtype inputs); a call through the token loop does not"
        ),
        "max_inference_chunksize": Caveat(
            "in eval, a prompt longer than config.max_inference_chunksize runs chunk by chunk, each chunk a call;"
            " with use_cache=False transformers makes the cache the chunks share in bf16, so states are rounded to"
            " bf16 between chunks, watched or not (use the cache, or pass a float32 xLSTMCache)"
        ),
        "decode steps in mode 'train'": Refused(
            ValueError,
            "config.mode 'train' runs _train_fn, transformers' chunk-wise kernel alone: it needs"
            " seq % chunk_size == 0, so decode steps raise there, watched or not",
        ),
        "mode 'train_with_padding'": Caveat(
            "its kernel returns no state, so nothing reaches the cache, watched or not"
        ),
        "backward with a cache": Refused(
            RuntimeError,
            "a backward through a prompt of >= chunk_size tokens run with use_cache=True raises in"
            " transformers (modified by an inplace operation: its chunk-wise kernel saves the cache's state tensor,"
            " which the model then copy_s into); an idle watched call runs that kernel too, a call that runs the"
            " token loop (hooks, writes, kept states) does not: train with use_cache=False",
        ),
        "left padding": Caveat(
            "xLSTM's forward takes no attention mask: the pads of a left-padded row enter its state, watched or not"
            " (a padded row's states differ from the row alone; pad on the right)"
        ),
        "beam search": Refused(
            ValueError,
            "transformers' generate refuses it for xLSTM with a cache (the xLSTMCache cannot be"
            " reordered), watched or not",
        ),
        "route_kernels": Refused(
            Unavailable,
            "the kernels are captured by each module when the model is built: there is nothing"
            " process-wide to reroute; a watch rebinds them per module",
        ),
        "xlstm package": Refused(
            Unavailable,
            "with the xlstm package installed, transformers builds xlstm's own mLSTMBlock"
            " (modeling_xlstm.external_xlstm) and none of these kernels exist: watch refuses the model",
        ),
    }


def _settings(original: Any) -> tuple[float, torch.dtype]:
    """ε and the state dtype that transformers' partial captured (defaults: xLSTMConfig's, 1e-6 and float32)."""
    keywords = getattr(original, "keywords", None) or {}
    eps = keywords.get("eps", 1e-6)
    step = keywords.get("mlstm_step_kernel")
    dtype_state = (getattr(step, "keywords", None) or {}).get("dtype_state", torch.float32)
    return eps, dtype_state


def _mlstm(
    query: Float[Tensor, "batch heads seq key_dim"],
    key: Float[Tensor, "batch heads seq key_dim"],
    value: Float[Tensor, "batch heads seq value_dim"],
    igate: Float[Tensor, "batch heads seq"],
    fgate: Float[Tensor, "batch heads seq"],
    state: MLSTMState,
    eps: float,
    dtype_state: torch.dtype,
    on_token: OnToken | None,
) -> tuple[Float[Tensor, "batch heads seq value_dim"], MLSTMState]:
    """The recurrence token by token: `mlstm_recurrent_step_native`'s operations, in its order and dtypes."""
    dtype_qkv = query.dtype
    dhqk = query.shape[-1]
    C, n, m = (x.to(dtype=dtype_state) for x in state)
    scaled = query * (dhqk ** (-0.5))  # b h t k   q̂ = q / √d_qk, elementwise: the step kernel's values, once
    outputs = []
    # one unbind of each input along the tokens (a slice a token would make the backward quadratic)
    steps = zip(
        scaled.unbind(2), key.unbind(2), value.unbind(2), igate[..., None].unbind(2), fgate[..., None].unbind(2)
    )
    for t, (q_scaled, k, v, i_pre, f_pre) in enumerate(steps):  # b h k, b h k, b h v, b h 1 (ĩ_t), b h 1 (f̃_t)
        f_log = F.logsigmoid(f_pre)  # b h 1   log σ(f̃_t)
        m_new = torch.max(f_log + m, i_pre)  # b h 1   m_t = max(log σ(f̃_t) + m_{t-1}, ĩ_t)
        f_act = torch.exp(f_log + m - m_new)  # b h 1   f'_t
        i_act = torch.exp(i_pre - m_new)  # b h 1   i'_t
        # (the clones are the step kernel's: the product must not save the cache's tensor, which the model
        # copies the new state into, for the backward)
        C = f_act[:, :, :, None] * C.clone() + i_act[:, :, :, None] * (k[:, :, :, None] @ v[:, :, None, :])  # b h k v
        n = f_act * n.clone() + i_act * k  # b h k   n_t = f'_t n_{t-1} + i'_t k_t
        m = m_new  # b h 1
        h_num = (q_scaled[:, :, None, :] @ C.to(dtype=dtype_qkv)).squeeze(2).to(dtype=dtype_state)  # b h v  C_tᵀq̂
        qn = (q_scaled[:, :, None, :] @ n[:, :, :, None].to(dtype=dtype_qkv)).squeeze(2)  # b h 1   n_tᵀ q̂_t
        h_denom = (torch.maximum(qn.abs(), torch.exp(-m)) + eps).to(dtype=dtype_state)  # b h 1
        outputs.append((h_num / h_denom).to(dtype=dtype_qkv))  # b h v   h̃_t
        C, n, m = (C.to(dtype=dtype_state), n.to(dtype=dtype_state), m.to(dtype=dtype_state))  # as the step returns
        if on_token is not None:
            C, n, m = on_token(t, MLSTMState(C, n, m))  # what token t+1 continues from (checked by the engine)
    return torch.stack(outputs, dim=2), MLSTMState(C, n, m)


def _initial(
    query: Tensor, value: Tensor, c_initial: Tensor | None, n_initial: Tensor | None, m_initial: Tensor | None
) -> MLSTMState:
    """The state a call starts from: the given one, or zeros in float32, as
    `wrap_chunkwise_arbitrary_sequence_length`."""
    batch, heads, _, dhqk = query.shape
    dhv = value.shape[-1]
    given = [c_initial is not None, n_initial is not None, m_initial is not None]
    if any(given) and not all(given):
        raise RecurrentHooksError(
            "mLSTM: c_initial, n_initial and m_initial must be given together"
            f" (got C {given[0]}, n {given[1]}, m {given[2]})"
        )
    if all(given):
        return MLSTMState(c_initial, n_initial, m_initial)
    zeros = lambda *shape: torch.zeros(*shape, device=query.device, dtype=torch.float32)  # noqa: E731
    return MLSTMState(zeros(batch, heads, dhqk, dhv), zeros(batch, heads, dhqk), zeros(batch, heads, 1))
