"""Mamba-1 (the selective scan, S6): token loops for its two kernels, a chunk-wise scan, and its discretization.

Glossary (code name, symbol in Gu & Dao, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces", 2023, Algorithm 2, shape as the prompt kernel takes it; the decode kernel drops `seq`):
    batch          b (`B` in Algorithm 2)  batch size
    seq            t (a position), L       tokens of one kernel call
    d_inner        D                       channels (`intermediate_size`); each has its own d_state-vector state
    d_state        N                       state size per channel
    hidden_states  x_t      [batch, d_inner, seq]      channel-major, the kernels' layout
    dt             -        [batch, d_inner, seq]      the step before bias and softplus
    delta_bias     -        [d_inner]                  `dt_bias` in the decode kernel
    (step)         Δ_t      [batch, seq, d_inner]      softplus(dt + delta_bias) (τ_Δ = softplus), float32
    A              A        [d_inner, d_state]         -exp(A_log), float32, negative
    B              B_t      [batch, d_state, seq]      input projection of token t
    C              C_t      [batch, d_state, seq]      output projection of token t
    D              D        [d_inner]                  skip connection (the Mamba block's, not Algorithm 2's)
    z              z_t      [batch, d_inner, seq]      gate of the Mamba block: y_t * silu(z_t)
    state          h_t      [batch, d_inner, d_state]  float32, the layout of transformers' cache
    (decay)        Ā_t = exp(Δ_t A)      [batch, seq, d_inner, d_state]  zero-order hold
    (drive)        B̄_t x_t = Δ_t B_t x_t  [batch, seq, d_inner, d_state]  the Euler step every implementation uses
    chunk          -        tokens of one chunk of the chunk-wise scan (`chunk_size`)
    steps          s_i      [chunk, batch, d_inner]    Δ summed from the chunk's start to token i
    running        P_i = exp(A s_i)  [chunk, batch, d_inner, d_state]  the decay from the chunk's start to token i

Recurrence, per channel d (h_t[d] is a d_state-vector, A[d] its decay rates):
    h_t = exp(Δ_t A) h_{t-1} + Δ_t B_t x_t
    y_t = C_t . h_t + D x_t,   times silu(z_t) when z is given

Dtypes, as in transformers' kernels (so that a bf16 or fp16 model rounds as it does unwatched): the step
is formed in dt's dtype (bias cast to it, softplus taken in it) and then used in float32; the state and
the recurrence are float32; C_t . h_t is read in C's dtype (the state cast to it, as transformers'
`ssm_state.to(C.dtype) @ C`), and the skip and gate are taken in the dtypes the kernel gets (prompt: x and
z in the model dtype with D as float32, so the result is float32; decode: D in the model dtype too, and
the result is cast to x's dtype). In float32 all of these are float32. In a float64 model the prompt
kernel computes in float64 (transformers' float32 A promoted with the model's Δ, x and B rounded to float32
first, as it does: `at_least_float32`), so its states are float64; the decode kernel casts to float32.

Module contents:
- `mamba_selective_scan`, `mamba_selective_state_update`: token loops with the signatures and results of
  transformers' kernels of the same names, plus a keyword-only `on_token` (and `initial_state` for the scan).
- `mamba_selective_scan_chunks`, `mamba_selective_scan_states`: the prompt kernel chunk-wise, from an
  `initial_state` (transformers' kernel takes none), without and with every token's state.
- `mamba_selective_scan_piece`, `mamba_selective_scan_piece_states`: what runs a piece of a Mamba-1 prompt
  in segments (`Segments.kernel`) and keeps every state (`Segments.all_states`): the chunk-wise scan for
  small states, the token loop for large ones (`CHUNKWISE_UP_TO`, measured).
- `discretize`: Δ_t, exp(Δ_t A) and Δ_t B_t x_t of every token, from the prompt kernel's arguments.
- the discretisation (`step_size`, `discrete_step`, `refuse_mamba_packed`) and the kernels' signatures (`kernel`,
  `SelectiveScanCall`, `StateUpdateCall`) are `ssm`'s, shared with Mamba-2.
- `SelectiveScan`, `PerHeadSelectiveScan`: the mixer kinds (zamba runs its kernels once per head), declared first,
  each after its adapter (`SelectiveScanAdapter`, `PerHeadSelectiveScanAdapter`); the kernels' maths follow them.
"""

import functools
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from jaxtyping import Float
from torch import Tensor

from ..engine.declare.effective import EffectiveAttention, decayed
from ..engine.declare.kernels import STATE_MEMORY, Kernel, Role, Segments
from ..engine.declare.limits import Caveat
from ..engine.declare.loops import OnChunk, OnToken, at_least_float32, chunked, plus, scratch_like, starting_state
from ..engine.errors import Unavailable
from ..engine.handle.adapter import KindAdapter
from ..engine.handle.mixer import RecurrentMixer
from ..engine.tracing import compiling
from ..engine.tracking.records import KernelCall
from .shared.conv import CONV_KERNELS
from .shared.recording import SPLIT_RECORDING
from .shared.ssm import SelectiveScanCall, StateUpdateCall, discrete_step, kernel, step_size

# the kernels, with transformers' signatures (written once: `ssm.kernel`); their maths follow the mixer kinds
mamba_selective_scan = kernel(SelectiveScanCall, "mamba_selective_scan", __name__, initial_state=None, on_token=None)
mamba_selective_scan_chunks = kernel(
    SelectiveScanCall, "mamba_selective_scan_chunks", __name__, initial_state=None, chunk=None
)
mamba_selective_scan_states = kernel(
    SelectiveScanCall, "mamba_selective_scan_states", __name__, initial_state=None, chunk=None, on_chunk=None
)
mamba_selective_scan_piece = kernel(SelectiveScanCall, "mamba_selective_scan_piece", __name__, initial_state=None)
mamba_selective_scan_piece_states = kernel(
    SelectiveScanCall, "mamba_selective_scan_piece_states", __name__, initial_state=None, on_chunk=None
)
mamba_selective_state_update = kernel(StateUpdateCall, "mamba_selective_state_update", __name__, on_token=None)

_RESTARTED = (
    "multi-token continuation: the model restarted its SSM state from zero (transformers'"
    " mamba_selective_scan takes no initial state), as it does unwatched; this call's hooks, writes"
    " and kept states see the states from zero, not from the cached state. Continue one token at a"
    " time for an exact continuation"
)


class SelectiveScanAdapter(KindAdapter):
    """Mamba-1's adapter: the restart of a multi-token continuation, its values and its effective attention."""

    def restart(self, kernel: Kernel, forward: Any) -> str | None:
        continuing = not forward.fresh and forward.tokens > 1
        return _RESTARTED if continuing and kernel.memory == STATE_MEMORY and kernel.role == "prompt" else None

    def token_values(self, mixer: RecurrentMixer, kernel_call: KernelCall) -> dict[str, Tensor]:
        x = kernel_call.inputs
        if kernel_call.kernel == self.kind.kernel_for(Role.PROMPT).name:
            token_major = lambda v: rearrange(v, "b c t -> b t c")  # noqa: E731
            dt = step_size(token_major(x["dt"]), x["delta_bias"], x["delta_softplus"])
            return {
                "x": token_major(x["hidden_states"]),
                "dt": dt,
                "B": token_major(x["B"]),
                "C": token_major(x["C"]),
                "y": token_major(kernel_call.output["output"]),
            }
        dt = step_size(x["dt"], x["dt_bias"], x["dt_softplus"])
        return {
            "x": x["hidden_states"][:, None],
            "dt": dt[:, None],
            "B": x["B"][:, None],
            "C": x["C"][:, None],
            "y": kernel_call.output["output"][:, None],
        }

    def _effective_attention_of_head(
        self, mixer: RecurrentMixer, calls: range, head: int, dtype: torch.dtype
    ) -> EffectiveAttention:
        """Mamba-1's exact map over one kernel call per head (zamba: one per mamba head)."""
        kind = self.kind
        xs, steps, Bs, Cs = [], [], [], []
        for index in calls:
            kernel_call = mixer.calls[index].kernel_calls[head]
            values = self.token_values(mixer, kernel_call)  # token-major x, Δ, B, C
            xs.append(values["x"]), steps.append(values["dt"]), Bs.append(values["B"]), Cs.append(values["C"])
        last = mixer.calls[calls[-1]].kernel_calls[head]
        first = mixer.calls[calls[0]].kernel_calls[head]
        x, delta, B, C = (torch.cat([p.to(dtype) for p in pieces], dim=1) for pieces in (xs, steps, Bs, Cs))
        A = last.inputs["A"].to(dtype)  # d n
        rows = xs[-1].shape[1]
        start = x.shape[1] - rows
        cum = (delta[..., None] * A).cumsum(1).transpose(1, 2)  # b d s n   c_s per channel and state entry
        B, C = B[:, None], C[:, None, start:]  # b 1 s n, b 1 t n
        weights = decayed(C, B, cum[:, :, start:], cum, start, strict=False) * delta.transpose(1, 2)[:, :, None]
        state = (
            first.inputs.get(kind.kernel(first.kernel).state_in)
            if kind.kernel(first.kernel).role is Role.DECODE
            else None
        )  # the scan starts from 0
        x_rows = x[:, start:].transpose(1, 2)[..., None]  # b d t 1
        if state is None:
            from_state = torch.zeros_like(x_rows)
        else:
            from_state = ((C * cum[:, :, start:].exp()) * state.to(dtype)[:, :, None]).sum(-1)[..., None]
        inputs = last.inputs
        D, z = inputs.get("D"), inputs.get("z")
        skip = None if D is None else D.to(dtype)[:, None, None] * x_rows
        if z is not None:
            z = (z if kind.kernel(last.kernel).role is Role.PROMPT else z[..., None]).to(dtype)  # b d t
            z = F.silu(z)[..., None]
        return EffectiveAttention(weights, x.transpose(1, 2)[..., None], from_state, skip, z, calls)

    def effective_attention(self, mixer: RecurrentMixer, calls: range, dtype: torch.dtype) -> EffectiveAttention:
        """Mamba-1's exact map: the heads' maps side by side (channel = head * head_dim + p)."""
        heads = len(mixer.calls[calls[-1]].kernel_calls)
        parts = [self._effective_attention_of_head(mixer, calls, head, dtype) for head in range(heads)]
        if heads == 1:
            return parts[0]
        fields = [torch.cat(f, dim=1) if f[0] is not None else None for f in zip(*(p[:5] for p in parts))]
        return EffectiveAttention(*fields, calls)


class SelectiveScan(RecurrentMixer):
    """A Mamba-1 mixer (mamba, falcon_mamba, jamba).

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            model(input_ids)
        w.mixers[0].states     # Float[Tensor, "batch seq d_inner d_state"]
        w.mixers[0].values()   # x, dt, B, C, y of every token

    The state h_t is `[batch, d_inner, d_state]`, float32, the layout of transformers' cache. The prompt
    kernel returns the last state (the mixer copies it into the cache); the decode kernel writes the new
    state into the cache tensor in place, and so does the library's loop, after any hook or write.
    transformers' prompt kernel cannot start from a state, so a prompt with hooks, writes or kept states at a
    few tokens runs the library's own scan on the pieces between them (chunk-wise for small states, the token
    loop for large ones), and one that keeps every state (no gradients) its all-states version; a hook on
    every token runs the token loop.
    """

    ADAPTER = SelectiveScanAdapter
    KERNELS = (
        # several tokens (a prompt): a scan from zeros, which takes no state; in segments, the library's
        # chunk-wise scan or token loop runs the pieces (they start from the state the previous one left)
        Kernel(
            name="mamba_selective_scan",
            role=Role.PROMPT,
            loop=mamba_selective_scan,
            state_in=None,
            results=("output", "final_state"),
            seq=("hidden_states", 2),
            segments=Segments(
                per_token={name: 2 for name in ("hidden_states", "dt", "B", "C", "z")},
                state_in="initial_state",
                final_flag="return_last_state",
                out_axis=2,
                tuple_without_final=False,
                kernel=mamba_selective_scan_piece,
                all_states=mamba_selective_scan_piece_states,
                on_chunk=True,
            ),
        ),
        # one token over the cached state, which it updates in place
        Kernel(
            name="mamba_selective_state_update",
            role=Role.DECODE,
            loop=mamba_selective_state_update,
            state_in="state",
            results=("output",),
            in_place=True,
        ),
        *CONV_KERNELS,
    )
    FUSED = ("mamba_inner_fn",)
    STATE = "batch d_inner d_state"
    INPUTS = {
        "hidden_states": "batch d_inner seq",
        "dt": "batch d_inner seq",
        "A": "d_inner d_state",
        "B": "batch d_state seq",
        "C": "batch d_state seq",
        "D": "d_inner",
        "z": "batch d_inner seq",
        "state": "batch d_inner d_state",
    }
    OUTPUTS = {"output": "batch d_inner seq", "final_state": "batch d_inner d_state"}
    VALUES = {
        "x": "batch seq d_inner",
        "dt": "batch seq d_inner",
        "B": "batch seq d_state",
        "C": "batch seq d_state",
        "y": "batch seq d_inner",
    }
    LIMITS = {
        "multi-token continuation": Caveat(
            "transformers' mamba_selective_scan takes no initial state, so a forward of several tokens over a cached"
            " state restarts the SSM state from zero (the model's own behaviour, watched or not; the convolution"
            " window carries over). Such a call runs as transformers runs it: its hooks, writes and kept states see"
            " the states from zero, and a RecurrentHooksWarning says so once per mixer and call. Continue one token"
            " at a time for an exact continuation"
        ),
        **SPLIT_RECORDING,
    }


class PerHeadSelectiveScanAdapter(SelectiveScanAdapter):
    """zamba's Mamba-1 adapter: a kernel call per mamba head, and the window channels of each."""

    def kernel_calls(self, module: Any) -> int:
        """One recurrence kernel call per mamba head (transformers' `n_mamba_heads`)."""
        return int(module.n_mamba_heads)

    def head_channels(self, head: int, heads: int, head_state: tuple[int, ...], channels: int) -> range:
        """The window's channels are the heads' x channels, head-major (zamba splits the convolution's output into
        heads of `head_dim` channels, and each head computes its dt, B and C from its own)."""
        head_dim = channels // heads
        if head_dim * heads != channels or head_dim != head_state[0]:
            raise Unavailable(
                f"{self.kind.__name__}: a window of {channels} channels is not {heads} heads of"
                f" head_dim {head_state[0]}"
            )
        return range(head * head_dim, (head + 1) * head_dim)


class PerHeadSelectiveScan(SelectiveScan):
    """A Mamba-1 mixer that runs its kernels once per mamba head inside one forward (zamba).

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            model(input_ids)
        w.mixers[0].states     # Float[Tensor, "batch seq heads head_dim d_state"]

    One call of the mixer makes one kernel call per head (`call.kernel_calls[h]`). The state is the cache's
    `[batch, heads, head_dim, d_state]`; kept states and `values()` stack the heads after `seq`. Hooks run
    once per head and token with that head's `[batch, head_dim, d_state]` state, `mixer.head` telling
    which; `set_state_after` takes the whole state and writes each head's slice. A reduction
    (`watch(reduce=...)`) sees every head's states, `[batch, chunk, heads, head_dim, d_state]`, once the last
    head's kernel call forms them (`visitor.HeldHeads`, `runners.reduce_heads_in_chunks`).
    """

    ADAPTER = PerHeadSelectiveScanAdapter
    KERNEL_PER_HEAD = True
    HEADS = True  # the kernel calls of one forward, one per mamba head
    STATE = "batch heads head_dim d_state"
    VALUES = {
        "x": "batch seq heads head_dim",
        "dt": "batch seq heads head_dim",
        "B": "batch seq heads d_state",
        "C": "batch seq heads d_state",
        "y": "batch seq heads head_dim",
    }
    # zamba's forward runs a recording cache's tokens as one prompt call per head (it reads no
    # recurrent_states_to_keep), so of SelectiveScan's limits it has the continuation's only
    LIMITS = {"multi-token continuation": SelectiveScan.LIMITS["multi-token continuation"]}


def discretize(
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
) -> tuple[
    Float[Tensor, "batch seq d_inner"],
    Float[Tensor, "batch seq d_inner d_state"],
    Float[Tensor, "batch seq d_inner d_state"],
]:
    """Δ_t, exp(Δ_t A) and Δ_t B_t x_t of every token, float32, token-major, from `mamba_selective_scan`'s arguments.

        names = ("hidden_states", "dt", "A", "B", "delta_bias", "delta_softplus")
        dt, decay, drive = discretize(**{k: v for k, v in call.inputs.items() if k in names})
        # states[:, t] == decay[:, t] * states[:, t - 1] + drive[:, t]   (before any state write)

    For the decode kernel's arguments add the seq axis: `discretize(x[..., None], dt[..., None], A,
    B[..., None], dt_bias, dt_softplus)`.
    """
    x, dt, B = (rearrange(v, "b c t -> b t c") for v in (hidden_states, dt, B))
    wide = at_least_float32(hidden_states.dtype)
    dt = step_size(dt, delta_bias, delta_softplus, dtype=wide)
    return (dt, *discrete_step(dt, A.to(wide), B.float().to(wide), x.float().to(wide)))


@mamba_selective_scan.body
def _token_loop(
    call: SelectiveScanCall, initial_state: Tensor | None, on_token: OnToken | None
) -> Tensor | tuple[Tensor, Tensor]:
    """The prompt kernel, token by token: same arguments and results as transformers' `mamba_selective_scan`.

    Returns y `[batch, d_inner, seq]` (D skip and silu(z) gate applied), and the last state
    `[batch, d_inner, d_state]` float32 when `return_last_state`. `use_mambapy` and
    `use_associative_scan` are accepted and ignored; so are unknown keyword arguments.
    `on_token(t, state)` is called after token t's state update and output; token t+1 continues from the
    state it returns, and the last one returned is the last state.
    `initial_state` is the library's own: transformers' kernel always starts from zeros, which is why a
    multi-token forward of a Mamba-1 model with a cache drops the cached state.
    """
    # transformers rounds x and B to float32 and promotes them with the model's Δ: float64 stays float64
    wide = at_least_float32(call.hidden_states.dtype)
    x = rearrange(call.hidden_states, "b d t -> b t d").float().to(wide)
    delta = step_size(rearrange(call.dt, "b d t -> b t d"), call.delta_bias, call.delta_softplus, dtype=wide)
    B_t = rearrange(call.B, "b n t -> b t n").float().to(wide)
    C_t = rearrange(call.C, "b n t -> b t n").to(call.hidden_states.dtype)  # transformers reads C.h in x's dtype
    y, state = _selective_scan(x, delta, call.A.to(wide), B_t, C_t, initial_state, on_token)
    return call.result(_prompt_result(rearrange(y, "b t d -> b d t"), call), state)


def _selective_scan(
    x: Float[Tensor, "batch seq d_inner"],
    dt: Float[Tensor, "batch seq d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "batch seq d_state"],
    C: Float[Tensor, "batch seq d_state"],
    initial_state: Float[Tensor, "batch d_inner d_state"] | None,
    on_token: OnToken | None,
) -> tuple[Float[Tensor, "batch seq d_inner"], Float[Tensor, "batch d_inner d_state"]]:
    """C_t h_t of every token (in C's dtype) and the last state (float32); token-major (no D, no gate).

    x, dt, A and B are float32; C is in the dtype transformers reads the output in (the model dtype), and
    each token's state is cast to it for the product, as transformers' kernels do.
    """
    batch, seq, d_inner = x.shape
    # a copy: the decode kernel's state is the cache tensor, written only at the end
    state = starting_state(initial_state, lambda: x.new_zeros(batch, d_inner, A.shape[-1]), x.dtype)
    outputs = []
    scratch = scratch_like(state)  # b d n   each token's drive (None with gradients)
    # per token from one unbind each: under autograd a slice's backward is a gradient of the whole tensor, per token
    for t, (dt_t, B_t, C_t, x_t) in enumerate(zip(*(v.unbind(1) for v in (dt, B, C, x)))):
        decay, drive = discrete_step(dt_t, A, B_t, x_t, scratch)  # b d n   exp(Δ_t A), Δ_t B_t x_t
        state = plus(decay * state, drive, scratch is not None)  # b d n   h_t (a new tensor)
        outputs.append(torch.matmul(state.to(C.dtype), C_t[:, :, None])[..., 0])  # b d   C_t . h_t
        if on_token is not None:
            state = on_token(t, state)  # b d n   what token t+1 continues from
    y = torch.stack(outputs, dim=1) if outputs else C.new_zeros(batch, 0, d_inner)
    return y, state


def _skip_and_gate(y: Tensor, x: Tensor, D: Tensor | None, z: Tensor | None) -> Tensor:
    """y + x D, times silu(z): y, x, z in one layout, D broadcast over it, each in the dtype it comes in
    (torch's promotion decides the result's, as in transformers' kernels)."""
    if D is not None:
        y = y + x * D
    if z is not None:
        y = y * F.silu(z)
    return y


def _prompt_result(y: Tensor, call: SelectiveScanCall) -> Tensor:
    """The prompt kernel's result from C_t . h_t `[batch, d_inner, seq]`: skip and gate, in transformers' dtype."""
    y = _skip_and_gate(y, call.hidden_states, None if call.D is None else call.D[:, None], call.z)
    dtype = functools.reduce(
        torch.promote_types, [v.dtype for v in (call.hidden_states, call.C, call.D, call.z) if v is not None]
    )
    return y.to(dtype)


@mamba_selective_scan_chunks.body
def _chunk_wise_scan(
    call: SelectiveScanCall, initial_state: Tensor | None, chunk: int | None
) -> Tensor | tuple[Tensor, Tensor]:
    """The prompt kernel chunk-wise (no per-token loop), from `initial_state` (zeros if None).

    Same arguments and results as transformers' `mamba_selective_scan`, which always starts from zeros:
    the library runs Mamba-1 prompts in segments with this (`Segments.kernel`). See `_scan_chunks`.
    """
    y, state, _ = _chunked(call, initial_state, chunk, False)
    return call.result(y, state)


@mamba_selective_scan_states.body
def _chunk_wise_states(
    call: SelectiveScanCall,
    initial_state: Tensor | None,
    chunk: int | None,
    on_chunk: OnChunk | None,
) -> tuple[Tensor | tuple[Tensor, Tensor], Float[Tensor, "seq batch d_inner d_state"] | None]:
    """`mamba_selective_scan_chunks`' results and every token's state, token first (when all are kept), or with
    `on_chunk` each chunk's states handed to it and None (`Segments.on_chunk`)."""
    y, state, every = _chunked(call, initial_state, chunk, on_chunk is None, on_chunk)
    return call.result(y, state), every


def _chunked(
    call: SelectiveScanCall,
    initial_state: Tensor | None,
    chunk: int | None,
    keep_every: bool,
    on_chunk: OnChunk | None = None,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The chunk-wise kernels' work: the result, the last state and every state (or None; with `on_chunk`, each
    chunk's states are handed to it)."""
    # token-first and contiguous, so that every per-chunk tensor is too (a chunk is a slice of the first axis)
    seq_first = lambda v: rearrange(v, "b c t -> t b c").contiguous()  # noqa: E731
    wide = at_least_float32(call.hidden_states.dtype)
    x = seq_first(call.hidden_states.float().to(wide))  # as the token loop: rounded to float32, then promoted
    bias = None if call.delta_bias is None else call.delta_bias[:, None]
    delta = seq_first(step_size(call.dt, bias, call.delta_softplus, dtype=wide))
    B_t = seq_first(call.B.float().to(wide))
    C_t = seq_first(call.C.to(call.hidden_states.dtype))  # transformers reads C.h in x's dtype
    seq, batch, d_inner = x.shape
    every = x.new_empty(seq, batch, d_inner, call.A.shape[-1]) if keep_every else None
    y, state = _scan_chunks(x, delta, call.A.to(wide), B_t, C_t, initial_state, chunk, every, on_chunk)
    return _prompt_result(rearrange(y, "t b d -> b d t"), call), state, every


_LOG_RANGE = 60.0  # how far a chunk's running decay may fall (e^-60): 1 / e^-60 ~ 1e26 stays far from float32's 3e38


def chunk_size(batch: int, d_inner: int, d_state: int) -> int:
    """Tokens per chunk of the chunk-wise scan, by the elements of one token's state (measured on this machine
    by benchmarks/selective_scan.py, see docs/performance.md): long chunks where the per-op overhead is what
    costs (tiny states), 16 tokens where memory traffic is (a chunk's tensors then stay in cache)."""
    return 64 if batch * d_inner * d_state <= 2048 else 16


def _scan_chunks(
    x: Float[Tensor, "seq batch d_inner"],
    dt: Float[Tensor, "seq batch d_inner"],
    A: Float[Tensor, "d_inner d_state"],
    B: Float[Tensor, "seq batch d_state"],
    C: Float[Tensor, "seq batch d_state"],
    initial_state: Float[Tensor, "batch d_inner d_state"] | None,
    chunk: int | None,
    every: Float[Tensor, "seq batch d_inner d_state"] | None,
    on_chunk: OnChunk | None = None,
) -> tuple[Float[Tensor, "seq batch d_inner"], Float[Tensor, "batch d_inner d_state"]]:
    """C_t . h_t of every token (in C's dtype) and the last state, a chunk of tokens at a time; token-first.

    Inside a chunk starting from h_0, the log decay from its start to token i is c_i = A s_i, with s_i the
    cumulative sum of Δ_j (A is the same at every token), and P_i = exp(c_i), per channel and state element:
        h_i = P_i (h_0 + sum_{j<=i} Δ_j B_j x_j / P_j)
    one cumulative sum along the chunk (a matmul) instead of a Python step per token. 1 / P_j grows as the
    decay does, so this form holds only for the state elements whose |c_i| stays within 60 over the chunk
    (1 / e^-60 ~ 1e26, far from float32's 3e38); the others (the fast-decaying channels, often a few
    percent) are gathered and stepped token by token through the chunk. With `every`, each token's state is
    written into it (else only a chunk's states are held); with `on_chunk`, each chunk's states are handed to
    `on_chunk(start, states)`, in one buffer of one chunk reused by the next (`Segments.on_chunk`).
    """
    seq, batch, d_inner = x.shape
    d_state = A.shape[-1]
    chunk = chunk or chunk_size(batch, d_inner, d_state)
    state = x.new_zeros(batch, d_inner, d_state) if initial_state is None else initial_state.to(x.dtype)
    rates = A.abs()  # d n   |c_i| = |s_i| |A|
    causal = torch.ones(chunk, chunk, dtype=x.dtype, device=x.device).tril()  # i j   1 where j <= i
    # i b d n   one chunk's states, reused by the next chunk when they are handed over (else each chunk's own)
    reused = x.new_empty(min(chunk, seq), batch, d_inner, d_state) if on_chunk is not None else None
    outputs = []
    for start in range(0, seq, chunk):
        stop = min(start + chunk, seq)
        size = stop - start
        dc, xc, Bc = dt[start:stop], x[start:stop], B[start:stop]  # i b d, i b d, i b n
        if every is not None:
            states = every[start:stop]  # i b d n
        else:
            states = reused[:size] if reused is not None else x.new_empty(size, batch, d_inner, d_state)  # i b d n
        drive = (dc * xc)[..., None] * Bc[..., None, :]  # j b d n   Δ_j B_j x_j
        steps = dc.cumsum(0)  # i b d   s_i
        running = torch.mul(steps[..., None], A).clamp_(-_LOG_RANGE, _LOG_RANGE).exp_()  # i b d n   P_i
        drive.div_(running)  # j b d n   Δ_j B_j x_j / P_j
        drive[0] += state  # h_0 + Δ_0 B_0 x_0 / P_0
        # the cumulative sum as a product with a lower-triangular matrix of ones: BLAS beats torch's cumsum
        # along the first axis many times over
        torch.matmul(causal[:size, :size], drive.view(size, -1), out=states.view(size, -1))  # i (b d n)
        states.mul_(running)  # i b d n   h_i
        fast = ((steps.abs().amax(0)[..., None] * rates) > _LOG_RANGE).view(-1).nonzero()[:, 0]  # k   (b d n) flat
        if len(fast):
            _step_through(fast, dc, xc, Bc, A, state, states)
        if every is None:
            outputs.append((states.to(C.dtype) @ C[start:stop, :, :, None])[..., 0])  # i b d   C_i . h_i
        if reused is None:
            state = states[-1]  # b d n
        else:
            state = states[-1].clone()  # b d n   (the next chunk overwrites the buffer)
            on_chunk(start, states)
    if every is not None:
        y = (every.to(C.dtype) @ C[..., None])[..., 0]  # t b d
    else:
        y = torch.cat(outputs) if outputs else C.new_zeros(0, batch, d_inner)
    return y, state.clone()


def _step_through(
    fast: Tensor,
    dt: Float[Tensor, "chunk batch d_inner"],
    x: Float[Tensor, "chunk batch d_inner"],
    B: Float[Tensor, "chunk batch d_state"],
    A: Float[Tensor, "d_inner d_state"],
    state: Float[Tensor, "batch d_inner d_state"],
    states: Float[Tensor, "chunk batch d_inner d_state"],
) -> None:
    """Overwrite the state elements `fast` (flat indices into `[batch, d_inner, d_state]`) of a chunk's `states`
    with the plain recurrence, token by token, on those elements only."""
    size, _, d_inner = dt.shape
    d_state = A.shape[-1]
    channel, element = fast // d_state, fast % (d_inner * d_state)  # k   (b d), (d n)
    row = fast // (d_inner * d_state) * d_state + fast % d_state  # k   (b n)
    dt_k = dt.reshape(size, -1)[:, channel]  # i k   Δ_i
    decay = torch.exp(dt_k * A.reshape(-1)[element])  # i k   exp(Δ_i A)
    drive = dt_k * x.reshape(size, -1)[:, channel] * B.reshape(size, -1)[:, row]  # i k   Δ_i B_i x_i
    h = state.reshape(-1)[fast]  # k
    out = []
    for i in range(size):
        h = torch.addcmul(drive[i], decay[i], h)  # k   h_i
        out.append(h)
    states.view(size, -1)[:, fast] = torch.stack(out)


@mamba_selective_state_update.body
def _decode_step(call: StateUpdateCall, on_token: OnToken | None) -> Tensor:
    """The decode kernel (one token): same arguments and result as transformers' `mamba_selective_state_update`.

    Returns y `[batch, d_inner]` in hidden_states' dtype and, like transformers, writes the new state
    into `state` in place (`copy_`): the mixer never writes it back to the cache. With `on_token` (called
    once, t=0) the state written is the one it returns. Unknown keyword arguments are ignored."""
    x = call.hidden_states.float()[:, None]  # b 1 d
    delta = step_size(call.dt, call.dt_bias, call.dt_softplus)[:, None]  # b 1 d
    y, new_state = _selective_scan(
        x, delta, call.A.float(), call.B.float()[:, None], call.C[:, None], call.state, on_token
    )
    call.state.copy_(new_state)
    return _skip_and_gate(y[:, 0], call.hidden_states, call.D, call.z).to(call.hidden_states.dtype)


CHUNKWISE_UP_TO = 4096  # state elements per token (batch * d_inner * d_state) up to which pieces run chunk-wise


def _chunk_wise(hidden_states: Tensor, A: Tensor) -> bool:
    """Whether a piece runs faster chunk-wise than by the token loop, by its state's size (measured on this
    machine, docs/performance.md, "Mamba-1: the chunk-wise selective scan"): up to ~4K elements a token's Python
    step costs more than its arithmetic, and the chunk-wise scan is faster; at mamba-130m dims the two cost about the
    same on their own, and with the fast-decaying elements a real model has, the chunk-wise scan is slower.
    Never inside torch.compile (which elements decay fast is data, and a graph cannot branch on it), nor with
    gradients on (the chunk-wise scan writes into its buffers in place)."""
    if compiling() or torch.is_grad_enabled():
        return False
    return hidden_states.shape[0] * hidden_states.shape[1] * A.shape[-1] <= CHUNKWISE_UP_TO


@mamba_selective_scan_piece.body
def _piece_by_size(call: SelectiveScanCall, initial_state: Tensor | None) -> Tensor | tuple[Tensor, Tensor]:
    """A piece of a Mamba-1 prompt from a state (`Segments.kernel`): `mamba_selective_scan_chunks` or the
    token loop `mamba_selective_scan`, whichever is faster at its shape (`_chunk_wise`); same arguments."""
    run = mamba_selective_scan_chunks if _chunk_wise(call.hidden_states, call.A) else mamba_selective_scan
    return run(*call, initial_state=initial_state)


@mamba_selective_scan_piece_states.body
def _piece_states_by_size(
    call: SelectiveScanCall,
    initial_state: Tensor | None,
    on_chunk: OnChunk | None,
) -> tuple[Tensor | tuple[Tensor, Tensor], Float[Tensor, "seq batch d_inner d_state"] | None]:
    """`mamba_selective_scan_piece` with every token's state, token first (`Segments.all_states`):
    `mamba_selective_scan_states`, or the token loop keeping the state of each token. With `on_chunk`, the states
    are handed to it a chunk at a time instead, and None returned for them (`Segments.on_chunk`: the token loop
    gathers them into a buffer of 16 tokens, `loops.chunked`)."""
    x = call.hidden_states
    if _chunk_wise(x, call.A):
        return mamba_selective_scan_states(*call, initial_state=initial_state, on_chunk=on_chunk)
    if on_chunk is not None:
        return mamba_selective_scan(*call, initial_state=initial_state, on_token=chunked(on_chunk, x.shape[2])), None
    seen: list[Tensor] = []
    result = mamba_selective_scan(
        *call, initial_state=initial_state, on_token=lambda t, state: seen.append(state) or state
    )
    every = (
        torch.stack(seen) if seen else x.new_zeros(0, *x.shape[:2], call.A.shape[-1], dtype=at_least_float32(x.dtype))
    )
    return result, every
