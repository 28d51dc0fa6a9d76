"""Mamba-2 (state space duality, SSD): token loops for its two kernels, and its discretization.

Glossary (code name, symbol in Dao & Gu, "Transformers are SSMs: Generalized Models and Efficient
Algorithms Through Structured State Space Duality", 2024, shape as the prompt kernel takes it):
    batch           b                   batch size
    seq             t (a position), T   tokens of one kernel call
    heads           H                   heads; each has its own scalar decay rate
    head_dim        P                   channels per head (`intermediate_size = heads * head_dim`)
    groups          G                   B/C groups (`n_groups`); head h reads group h // (heads // groups)
    d_state         N                   state size
    hidden_states   x_t      [batch, seq, heads, head_dim]
    dt              -        [batch, seq, heads]                   the step before bias, softplus and clamp
    dt_bias         -        [heads]
    dt_limit        -        (low, high)                           clamp of Δ_t (prompt kernel only)
    (step)          Δ_t      [batch, seq, heads]                   clamp(softplus(dt + dt_bias), dt_limit), float32
    A               a_h      [heads]                               -exp(A_log), float32, negative: a scalar per head
    B               B_t      [batch, seq, groups, d_state]
    C               C_t      [batch, seq, groups, d_state]
    D               D_h      [heads]                               skip connection
    z               z_t      decode only: [batch, heads, head_dim]  gate y_t * silu(z_t) (falcon_h1)
    initial_states  h_0      [batch, heads, head_dim, d_state]
    state           h_t      [batch, heads, head_dim, d_state]     float32, the layout of transformers' cache
    (decay)         exp(Δ_t a_h)   [batch, seq, heads]
    (drive)         Δ_t x_t B_t^T  [batch, seq, heads, head_dim, d_state]

Recurrence, per head (h_t is a head_dim x d_state matrix):
    h_t = exp(Δ_t a_h) h_{t-1} + Δ_t x_t B_t^T
    y_t = h_t C_t + D_h x_t

The decode kernel takes the per-head parameters expanded over head_dim, as the mixers pass them:
dt `[batch, heads, head_dim]`, A `[heads, head_dim, d_state]`, D and dt_bias `[heads, head_dim]`,
B/C `[batch, groups, d_state]`; the loop uses them as given (per channel), so nothing assumes they
are constant over head_dim.

As in transformers: the step is formed in dt's dtype (bias cast to it, softplus and clamp taken in it);
the prompt kernel clamps Δ to `dt_limit` even without softplus (the default (0, inf) sets negative steps
to 0), the decode kernel never clamps; the prompt kernel ignores `z` (it arrives in `**kwargs`) and
returns float32 whatever the input dtype; the decode kernel applies `z` and returns hidden_states' dtype.
The prompt loop runs in float32, as transformers' prompt kernel does. The decode loop computes in the
dtypes and order of transformers' decode kernel: Δ B x in the model dtype (then added to the float32
state), h C and the skip in the model dtype; so in a bf16 model its output rounds as transformers' does.

Module contents:
- `mamba2_chunk_scan`, `mamba2_selective_state_update`: token loops with the signatures and results of
  transformers' kernels of the same names, plus a keyword-only `on_token`.
- `mamba2_chunk_scan_states`: the prompt kernel chunk-wise, with every token's state (when all are kept; into
  `out` when given, or a chunk at a time to `on_chunk`); `mamba2_chunk_scan_adjoint`: its adjoint recurrence, right
  to left (`Segments.adjoint`).
- `discretize`: Δ_t, exp(Δ_t a_h) and Δ_t x_t B_t^T of every token, from the prompt kernel's arguments.
- `Mamba2StateSpace`: the mixer kind, declared first (after its adapter, `Mamba2StateSpaceAdapter`: its heads'
  window channels, its values, its effective attention); the kernels' maths follow it. The kernels' signatures
  (`kernel`, `ChunkScanCall`, `StateUpdateCall`) and the discretisation are `ssm`'s, shared with Mamba-1.
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from einops import einsum, repeat
from jaxtyping import Float
from torch import Tensor

from ..engine.declare.effective import EffectiveAttention, decayed
from ..engine.declare.kernels import Kernel, Role, Segments
from ..engine.declare.limits import Caveat
from ..engine.declare.loops import (
    OnChunk,
    OnToken,
    Visit,
    causal_decay,
    chunk_formed,
    flushed_exp,
    plus,
    rank_one_steps,
    scratch_like,
    starting_state,
    states_buffer,
    visited,
)
from ..engine.errors import Unavailable
from ..engine.handle.adapter import KindAdapter
from ..engine.handle.mixer import RecurrentMixer
from ..engine.paths.costs import Shape
from ..engine.tracking.records import KernelCall
from .shared.conv import CONV_KERNELS
from .shared.recording import SPLIT_RECORDING
from .shared.ssm import REQUIRED, ChunkScanCall, StateUpdateCall, discrete_step, kernel, step_size

# the kernels, with transformers' signatures (written once: `ssm.kernel`); their maths follow the mixer kind
mamba2_chunk_scan = kernel(ChunkScanCall, "mamba2_chunk_scan", __name__, on_token=None)
mamba2_chunk_scan_states = kernel(
    ChunkScanCall, "mamba2_chunk_scan_states", __name__, chunk=16, out=None, on_chunk=None, factors=None
)
mamba2_chunk_scan_adjoint = kernel(
    ChunkScanCall, "mamba2_chunk_scan_adjoint", __name__, grad_output=REQUIRED, grad_final=REQUIRED, visit=REQUIRED
)
mamba2_selective_state_update = kernel(StateUpdateCall, "mamba2_selective_state_update", __name__, on_token=None)


def _cost_shape(arguments: dict[str, Any]) -> Shape:
    """The prompt kernel call's shape for the cost model (`engine.paths.costs`): transformers' kernel pads to
    `chunk_size`. Its footprint, measured at mamba2-130m dims (tests/engine/test_path_memory.py): the kernel's graph per
    chunk unit, the token loop's states a token under autograd."""
    batch, _, heads, head_dim = arguments["hidden_states"].shape
    return Shape(
        "ssd", batch, heads, head_dim, arguments["B"].shape[-1], arguments["chunk_size"], graph=3.3, loop_graph=1.1
    )  # above the measured (docs/performance.md, "Paths chosen by memory")


class Mamba2StateSpaceAdapter(KindAdapter):
    """Mamba-2's adapter: its heads' window channels, its values and its effective attention."""

    def head_channels(self, head: int, heads: int, head_state: tuple[int, ...], channels: int) -> list[int]:
        """The window's channels are `[x | B | C]` (`x`: heads x head_dim, `B`, `C`: groups x d_state): head h reads
        its own x channels and the B and C channels of its group h // (heads // groups), which the other heads of
        that group read too."""
        head_dim, d_state = head_state
        groups, rest = divmod(channels - heads * head_dim, 2 * d_state)
        if rest or groups < 1 or heads % groups:
            raise Unavailable(
                f"{self.kind.__name__}: a window of {channels} channels is not [x | B | C] for {heads}"
                f" heads of head_dim {head_dim}, d_state {d_state}"
            )
        group, start = head // (heads // groups), heads * head_dim
        b = range(start + group * d_state, start + (group + 1) * d_state)
        return [*range(head * head_dim, (head + 1) * head_dim), *b, *(c + groups * d_state for c in b)]

    def token_values(self, mixer: RecurrentMixer, kernel_call: KernelCall) -> dict[str, Tensor]:
        x = kernel_call.inputs
        if kernel_call.kernel == self.kind.kernel_for(Role.PROMPT).name:
            dt = step_size(x["dt"], x["dt_bias"], x["dt_softplus"], x["dt_limit"])
            return {
                "x": x["hidden_states"],
                "dt": dt,
                "decay": torch.exp(dt * x["A"].float()),
                "B": x["B"],
                "C": x["C"],
                "y": kernel_call.output["output"],
            }
        # the decode kernel gets the per-head parameters expanded over head_dim: channel 0 is the head's
        dt = step_size(x["dt"][..., 0], None if x["dt_bias"] is None else x["dt_bias"][..., 0], x["dt_softplus"])
        return {
            "x": x["hidden_states"][:, None],
            "dt": dt[:, None],
            "decay": torch.exp(dt * x["A"][:, 0, 0].float())[:, None],
            "B": x["B"][:, None],
            "C": x["C"][:, None],
            "y": kernel_call.output["output"][:, None],
        }

    def effective_attention(self, mixer: RecurrentMixer, calls: range, dtype: torch.dtype) -> EffectiveAttention:
        """Mamba-2's exact map (SSD: a scalar decay per head)."""
        kind = self.kind
        xs, steps, Bs, Cs = [], [], [], []
        for index in calls:
            # token-major x, Δ (clamped as the kernel), B, C
            values = self.token_values(mixer, mixer.calls[index].kernel_calls[0])
            xs.append(values["x"]), steps.append(values["dt"]), Bs.append(values["B"]), Cs.append(values["C"])
        last, first = mixer.calls[calls[-1]].kernel_calls[0], mixer.calls[calls[0]].kernel_calls[0]
        x, delta, B, C = (torch.cat([p.to(dtype) for p in pieces], dim=1) for pieces in (xs, steps, Bs, Cs))
        heads = x.shape[2]
        B, C = (repeat(v, "b s g n -> b (g r) s n", r=heads // v.shape[2]) for v in (B, C))  # head h reads group h // r
        decode = kind.kernel(last.kernel).role is Role.DECODE
        A = last.inputs["A"]
        A = (A[:, 0, 0] if decode else A).to(dtype)  # h   (the decode kernel gets it expanded over head_dim, d_state)
        rows = xs[-1].shape[1]
        start = x.shape[1] - rows
        delta = delta.transpose(1, 2)  # b h s
        cum = (delta * A[:, None]).cumsum(2)[..., None]  # b h s 1
        weights = decayed(C[:, :, start:], B, cum[:, :, start:], cum, start, strict=False) * delta[:, :, None]
        values = x.transpose(1, 2)  # b h s p
        state = first.inputs["state" if kind.kernel(first.kernel).role is Role.DECODE else "initial_states"]
        if state is None:
            from_state = torch.zeros_like(values[:, :, start:])
        else:
            from_state = torch.einsum("bhpn,bhtn->bhtp", state.to(dtype), C[:, :, start:]) * cum[:, :, start:].exp()
        D = last.inputs.get("D")
        skip = None
        if D is not None:
            D = (D[:, 0] if decode else D).to(dtype)
            skip = D[:, None, None] * values[:, :, start:]
        z = last.inputs.get("z") if decode else None
        gate = None if z is None else F.silu(z.to(dtype))[:, :, None]
        return EffectiveAttention(weights, values, from_state, skip, gate, calls)


class Mamba2StateSpace(RecurrentMixer):
    """A Mamba-2 mixer (mamba2, bamba, falcon_h1, granitemoehybrid, nemotron_h, zamba2).

        with recurrent_hooks.watch(model, keep=("states",)) as w:
            model(input_ids)
        w.mixers[0].states     # Float[Tensor, "batch seq heads head_dim d_state"]
        w.mixers[0].values()   # x, dt, decay, B, C, y of every token

    The state h_t is `[batch, heads, head_dim, d_state]`, float32, the layout of transformers' cache.
    Every token's state is a real state, not a chunk boundary: a prompt with hooks at a few tokens runs
    the chunk scan in segments ending at those tokens, every state kept comes from the chunk-wise
    `mamba2_chunk_scan_states`, and a hook on every token runs the token loop (or, without gradients and at
    a small state, `mamba2_chunk_scan_states` a block of tokens at a time: `blocks`). The prompt kernel
    takes the cached state (`initial_states`) and returns the last one; the decode kernel writes the new
    state into the cache tensor in place, and so does the library's loop, after any hook or write.
    """

    ADAPTER = Mamba2StateSpaceAdapter
    KERNELS = (
        Kernel(
            name="mamba2_chunk_scan",
            role=Role.PROMPT,
            loop=mamba2_chunk_scan,
            state_in="initial_states",
            results=("output", "final_state"),
            seq=("hidden_states", 1),
            segments=Segments(
                per_token={name: 1 for name in ("hidden_states", "dt", "B", "C")},
                state_in="initial_states",
                final_flag="return_final_states",
                out_axis=1,
                tuple_without_final=False,
                all_states=mamba2_chunk_scan_states,
                on_chunk=True,
                readouts=16,
                adjoint=mamba2_chunk_scan_adjoint,
                blocks_below=24576,  # 24 heads of 64 x 16 at batch 1 (docs/performance.md)
                shape=_cost_shape,
                chunk_argument="chunk_size",
            ),
        ),
        # one token over the cached state, which it updates in place
        Kernel(
            name="mamba2_selective_state_update",
            role=Role.DECODE,
            loop=mamba2_selective_state_update,
            state_in="state",
            results=("output",),
            in_place=True,
        ),
        *CONV_KERNELS,
    )
    FUSED = ("mamba2_split_conv1d_scan_combined",)
    STATE = "batch heads head_dim d_state"
    HEADS = True  # head h reads B/C group h // (heads // groups)
    CONTINUES_CACHE = True  # the chunk scan takes the cached state as `initial_states`
    INPUTS = {
        "hidden_states": "batch seq heads head_dim",
        "dt": "batch seq heads",
        "A": "heads",
        "B": "batch seq groups d_state",
        "C": "batch seq groups d_state",
        "D": "heads",
        "initial_states": "batch heads head_dim d_state",
        "state": "batch heads head_dim d_state",
    }
    OUTPUTS = {"output": "batch seq heads head_dim", "final_state": "batch heads head_dim d_state"}
    VALUES = {
        "x": "batch seq heads head_dim",
        "dt": "batch seq heads",
        "decay": "batch seq heads",
        "B": "batch seq groups d_state",
        "C": "batch seq groups d_state",
        "y": "batch seq heads head_dim",
    }
    LIMITS = {
        "dt_limit at decode steps": Caveat(
            "transformers' decode kernel does not clamp dt to time_step_limit (its prompt kernel does); the library's"
            " loops do the same, so with a non-default limit a prompt and its decode steps compute dt differently,"
            " watched or not"
        ),
        **SPLIT_RECORDING,
    }


def discretize(
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> tuple[
    Float[Tensor, "batch seq heads"],
    Float[Tensor, "batch seq heads"],
    Float[Tensor, "batch seq heads head_dim d_state"],
]:
    """Δ_t, exp(Δ_t a_h) and Δ_t x_t B_t^T of every token, float32, from `mamba2_chunk_scan`'s arguments.

        names = ("hidden_states", "dt", "A", "B", "dt_bias", "dt_softplus", "dt_limit")
        dt, decay, drive = discretize(**{k: v for k, v in call.inputs.items() if k in names})
        # states[:, t] == decay[:, t, :, None, None] * states[:, t - 1] + drive[:, t]   (before any state write)

    For the decode kernel's arguments take channel 0 of the expanded parameters, add the seq axis and
    do not clamp: `discretize(x[:, None], dt[:, None, :, 0], A[:, 0, 0], B[:, None], dt_bias[:, 0],
    dt_softplus, (-inf, inf))`.
    """
    dt = step_size(dt, dt_bias, dt_softplus, dt_limit)
    decay, drive = discrete_step(
        dt[..., None], A.float()[:, None, None], _per_head(B, hidden_states.shape[-2]), hidden_states.float()
    )
    return dt, decay[..., 0, 0], drive


def _per_head(v: Float[Tensor, "*lead groups d_state"], heads: int) -> Float[Tensor, "*lead heads d_state"]:
    """B or C for every head, float32: head h reads group h // (heads // groups)."""
    return repeat(v.float(), "... g n -> ... (g r) n", r=heads // v.shape[-2]).contiguous()  # token-major (see below)


@mamba2_chunk_scan.body
def _token_loop(call: ChunkScanCall, on_token: OnToken | None) -> Tensor | tuple[Tensor, Tensor]:
    """The prompt kernel, token by token: same arguments and results as transformers' `mamba2_chunk_scan`.

    Returns y `[batch, seq, heads, head_dim]` float32 (D skip applied, no gate), and the last state
    `[batch, heads, head_dim, d_state]` float32 when `return_final_states`. `chunk_size` is accepted and
    ignored; so are `z` and other unknown keyword arguments (transformers' kernel ignores `z` too: the
    mixer gates afterwards). `on_token(t, state)` is called after token t's state update and output;
    token t+1 continues from the state it returns, and the last one returned is the final state.
    """
    heads = call.hidden_states.shape[2]
    # a token-major copy: the mixers hand over a view whose token axis is the fastest (the conv output
    # transposed), which makes every step of the loop a strided gather (docs/performance.md, "The path benchmark")
    x = call.hidden_states.float().contiguous()
    delta = step_size(call.dt, call.dt_bias, call.dt_softplus, call.dt_limit)  # b t h
    y, state = _ssd(
        x,
        delta[..., None],
        call.A.float()[:, None, None],
        _per_head(call.B, heads),
        _per_head(call.C, heads),
        call.initial_states,
        on_token,
    )
    if call.D is not None:
        y = y + call.D[:, None] * x  # float32 (or D's dtype if wider), as transformers
    return call.result(y, state)


def _ssd(
    x: Float[Tensor, "batch seq heads head_dim"],
    dt: Float[Tensor, "batch seq heads q"],
    A: Float[Tensor, "heads q m"],
    B: Float[Tensor, "batch seq heads d_state"],
    C: Float[Tensor, "batch seq heads d_state"],
    initial_state: Float[Tensor, "batch heads head_dim d_state"] | None,
    on_token: OnToken | None,
) -> tuple[Float[Tensor, "batch seq heads head_dim"], Float[Tensor, "batch heads head_dim d_state"]]:
    """h_t C_t of every token and the last state; float32 in and out (no D, no gate).

    q is 1 (prompt: a step per head) or head_dim (decode: expanded), m is 1 or d_state, as in `discrete_step`.
    """
    batch, seq, heads, head_dim = x.shape
    # a copy: the decode kernel's state is the cache tensor, written only at the end
    state = starting_state(initial_state, lambda: x.new_zeros(batch, heads, head_dim, B.shape[-1]))
    outputs = []
    scratch = scratch_like(state)  # b h p n   each token's drive (None with gradients)
    # per token from one unbind each: under autograd a slice's backward is a gradient of the whole tensor, per token
    for t, (dt_t, B_t, C_t, x_t) in enumerate(zip(*(v.unbind(1) for v in (dt, B, C, x)))):
        decay, drive = discrete_step(dt_t, A, B_t, x_t, scratch)  # b h q m, b h p n   exp(Δ_t a_h), Δ_t x_t B_t^T
        state = plus(decay * state, drive, scratch is not None)  # b h p n   h_t (a new tensor)
        outputs.append(einsum(state, C_t, "b h p n, b h n -> b h p"))  # b h p   h_t C_t
        if on_token is not None:
            state = on_token(t, state)  # b h p n   what token t+1 continues from
    y = torch.stack(outputs, dim=1) if outputs else x.new_zeros(batch, 0, heads, head_dim)
    return y, state


ROW_STEPS_FROM = 16_384  # state elements from which a chunk's states are formed token by token (measured on a CPU:
# docs/performance.md, "Performance, third round")


@mamba2_chunk_scan_states.body
def _chunk_wise_states(
    call: ChunkScanCall,
    chunk: int,
    out: Tensor | None,
    on_chunk: OnChunk | None,
    factors: tuple[Tensor, Tensor] | None,
) -> tuple[Tensor | tuple[Tensor, Tensor], Float[Tensor, "seq batch heads head_dim d_state"] | None]:
    """`mamba2_chunk_scan`'s results and every token's state, token first, chunk by chunk.

    Inside a chunk starting from h_0, with c_i the cumulative log decay (sum of Δ a_h) from the chunk
    start to token i, and w_ij = exp(c_i - c_j) for j <= i (the decay from token j to i, at most 1), y comes from
    the chunk's attention form, which reads no state,
        y_i = exp(c_i) h_0 C_i + sum_{j<=i} w_ij (C_i . B_j) Δ_j x_j + D_h x_i
    and the states are formed token by token, h_i = exp(Δ_i a_h) h_{i-1} + Δ_i x_i B_i^T (`loops.rank_one_steps`:
    two passes over a state a token, each written once where it is kept). Below `ROW_STEPS_FROM` state elements
    (batch included), a chunk's states are formed at once instead (`_states_at_once`),
    h_i = exp(c_i) h_0 + sum_{j<=i} w_ij Δ_j x_j B_j^T (one product of inner size chunk per head), and read for
    y_i = h_i C_i + D_h x_i: there the steps' Python calls cost more than the product, which is slower on large
    states (docs/performance.md, "Performance, third round"). `chunk_size` is accepted and ignored. The states go into
    `out` (float32, at least seq tokens) when given: a reused buffer is not paged in again, as a fresh one is.

    With `on_chunk`, each chunk's states go to `on_chunk(start, states)` instead, in one buffer of one chunk reused
    by the next (`Segments.on_chunk`), and None is returned for them. With `factors` too, it gets linear readouts,
    without the states (`_chunk_readouts`).
    """
    batch, seq, heads, head_dim = call.hidden_states.shape
    x = call.hidden_states.float().movedim(1, 0)  # t b h p
    delta = step_size(call.dt, call.dt_bias, call.dt_softplus, call.dt_limit).movedim(1, 0)  # t b h
    B_h, C_h = (_per_head(v, heads).movedim(1, 0) for v in (call.B, call.C))  # t b h n
    log_decay = delta * call.A.float()  # t b h   Δ_t a_h
    d_state = B_h.shape[-1]
    state = x.new_zeros(batch, heads, head_dim, d_state) if call.initial_states is None else call.initial_states.float()
    shape = (seq, batch, heads, head_dim, d_state)
    every = (
        x.new_empty(0 if factors is not None else min(chunk, seq), *shape[1:])
        if on_chunk is not None  # reused
        else x.new_empty(shape)
        if out is None
        else states_buffer(out, shape)
    )  # i b h p n (none: readouts), t b h p n
    y = x.new_empty(x.shape)  # t b h p
    row_steps = factors is not None or math.prod(shape[1:]) >= ROW_STEPS_FROM
    for start in range(0, seq, chunk):
        xc, dc, Bc, Cc, lc = (v[start : start + chunk] for v in (x, delta, B_h, C_h, log_decay))  # i b h ..
        size = xc.shape[0]
        cum = lc.cumsum(0)  # i b h   c_i
        weights = causal_decay(cum)  # i j b h   w_ij
        stepped = dc[..., None] * xc  # i b h p   Δ_i x_i
        states = every[start : start + size] if on_chunk is None else every[:size]  # i b h p n   (readouts: none)
        if row_steps:
            scores = weights * torch.einsum("ibhn,jbhn->ijbh", Cc, Bc)  # i j b h   w_ij C_i . B_j
            from_start = torch.einsum("bhpn,ibhn,ibh->ibhp", state, Cc, flushed_exp(cum))  # i b h p   exp(c_i) h_0 C_i
            y[start : start + size] = torch.einsum("ijbh,jbhp->ibhp", scores, stepped) + from_start  # i b h p   h_i C_i
            if factors is not None:
                readouts, state = _chunk_readouts(factors, state, cum, weights, stepped, Bc)  # i b h r, b h p n
                on_chunk(start, readouts)
                continue
            decay = flushed_exp(lc)[..., None]  # i b h 1   exp(Δ_i a_h)
            rank_one_steps(states, state, decay, stepped, Bc)  # h_i = exp(Δ_i a_h) h_{i-1} + Δ_i x_i B_i^T
        else:
            y[start : start + size] = _states_at_once(states, state, cum, weights, stepped, Bc, Cc)  # i b h p
        state = chunk_formed(states, start, on_chunk)  # b h p n
    if call.D is not None:
        y = y + call.D[:, None] * x
    return call.result(y.movedim(0, 1), state), (every if on_chunk is None else None)


def _states_at_once(
    states: Tensor, state: Tensor, cum: Tensor, weights: Tensor, stepped: Tensor, B: Tensor, C: Tensor
) -> Float[Tensor, "i batch heads head_dim"]:
    """A chunk's states into `states` `[i, batch, heads, head_dim, d_state]` by one product per head, h_i = exp(c_i)
    h_0 + sum_{j<=i} w_ij Δ_j x_j B_j^T, and y_i = h_i C_i read from them (for small states: `ROW_STEPS_FROM`).
    h_0 `state`, c `cum` `[i, b, h]`, w `weights` `[i, j, b, h]`, Δ x `stepped` `[j, b, h, p]`, B and C
    `[., b, h, n]`."""
    drive = stepped[..., None] * B[..., None, :]  # j b h p n   Δ_j x_j B_j^T
    mixed = weights.permute(2, 3, 0, 1) @ drive.permute(1, 2, 0, 3, 4).flatten(3)  # b h i (p n)
    states.copy_(mixed.unflatten(-1, states.shape[-2:]).permute(2, 0, 1, 3, 4))
    states.addcmul_(flushed_exp(cum)[..., None, None], state)  # + exp(c_i) h_0
    return (states @ C[..., None]).squeeze(-1)  # i b h p   h_i C_i


def _chunk_readouts(
    factors: tuple[Tensor, Tensor],
    state: Tensor,
    cum: Tensor,
    weights: Tensor,
    stepped: Tensor,
    B: Tensor,
) -> tuple[Float[Tensor, "i batch heads r"], Float[Tensor, "batch heads head_dim d_state"]]:
    """A chunk's rank-r linear readouts sum_r a_r^T h_i b_r per head, and its last state, without forming the states
    in between (the probe `rh.probe(a, b)` at the cost of a query):
        a^T h_i b = exp(c_i) a^T h_0 b + sum_{j<=i} w_ij (a . Δ_j x_j) (B_j . b)
        h_last = exp(c_last) h_0 + sum_j w_last,j Δ_j x_j B_j^T
    a `[heads, r, head_dim]`, b `[heads, r, d_state]`; h_0 `state` `[batch, heads, head_dim, d_state]`; c `cum`
    `[i, batch, heads]`, w `weights` `[i, j, batch, heads]`, Δ x `stepped` `[j, batch, heads, head_dim]`, B `[j,
    batch, heads, d_state]`."""
    a, b = factors
    start = torch.einsum("bhpn,hrp,hrn->bhr", state, a, b)  # b h r   a^T h_0 b
    written = torch.einsum("jbhp,hrp->jbhr", stepped, a) * torch.einsum("jbhn,hrn->jbhr", B, b)  # j b h r
    readouts = flushed_exp(cum)[..., None] * start + torch.einsum("ijbh,jbhr->ibhr", weights, written)  # i b h r
    last = flushed_exp(cum[-1])[..., None, None] * state + torch.einsum("jbh,jbhp,jbhn->bhpn", weights[-1], stepped, B)
    return readouts, last  # (b h p n: the state after the chunk)


@mamba2_chunk_scan_adjoint.body
def _adjoint(
    call: ChunkScanCall, grad_output: Tensor | None, grad_final: Tensor | None, visit: Visit
) -> Float[Tensor, "batch heads head_dim d_state"]:
    """The prompt kernel's adjoint recurrence, right to left (`Segments.adjoint`): with mu_t = d m / d h_t
    through the tokens after t (mu_{T-1} the final state's gradient) and dy_t the output's gradient,
        mu_{t-1} = exp(Δ_t a_h) (mu_t + dy_t C_t^T)
    the transpose of h_t = exp(Δ_t a_h) h_{t-1} + Δ_t x_t B_t^T, y_t = h_t C_t + D_h x_t. Calls `visit(t, mu_t)`
    at each token and returns mu_{-1}, the initial state's gradient; float32."""
    batch, seq, heads, head_dim = call.hidden_states.shape
    delta = step_size(call.dt, call.dt_bias, call.dt_softplus, call.dt_limit)  # b t h
    decay = torch.exp(delta * call.A.float())  # b t h   exp(Δ_t a_h)
    C_h = _per_head(call.C, heads)  # b t h n
    mu = (
        call.hidden_states.new_zeros(batch, heads, head_dim, C_h.shape[-1], dtype=torch.float32)
        if grad_final is None
        else grad_final.to(torch.float32, copy=True)
    )
    grad_output = None if grad_output is None else grad_output.to(torch.float32)
    for t in reversed(range(seq)):
        mu = visited(visit, t, mu)  # b h p n   mu_t: what a change of the state after token t does to m
        # (in place from here: mu is this loop's own tensor, which `visit` does not keep)
        if grad_output is not None:
            mu.addcmul_(grad_output[:, t, :, :, None], C_h[:, t, :, None, :])  # b h p n   + dy_t C_t^T
        mu.mul_(decay[:, t, :, None, None])  # b h p n   exp(Δ_t a_h) (..)
    return mu


@mamba2_selective_state_update.body
def _decode_step(call: StateUpdateCall, on_token: OnToken | None) -> Tensor:
    """The decode kernel (one token): same arguments and result as transformers' `mamba2_selective_state_update`.

    Returns y `[batch, heads, head_dim]` in hidden_states' dtype (D skip and silu(z) gate applied) and,
    like transformers, writes the new state into `state` in place (`copy_`): the mixer never writes it
    back to the cache. With `on_token` (called once, t=0) the state written is the one it returns.
    No `dt_limit` clamp, as in transformers. Unknown keyword arguments are ignored."""
    x = call.hidden_states  # b h p
    # in the dtypes and order of transformers' kernel: Δ in dt's dtype, exp(Δ A) in float32, Δ B x in the
    # promotion of dt, B and x (the model dtype), the state float32, h C and the skip in C's and x's dtypes
    dt = call.dt if call.dt_bias is None else call.dt + call.dt_bias.to(call.dt.dtype)
    if call.dt_softplus:
        dt = F.softplus(dt)
    dt = dt[..., None]  # b h p 1
    decay = torch.exp(dt.float() * call.A.float())  # b h p n   exp(Δ a_h)
    B_h, C_h = (repeat(v, "b g n -> b (g r) n", r=x.shape[1] // v.shape[-2]) for v in (call.B, call.C))  # b h n
    drive = (dt * B_h[:, :, None, :]) * x[..., None]  # b h p n   Δ B x
    new_state = call.state.to(torch.float32) * decay + drive  # b h p n   h_t (a new tensor: the cache is written last)
    y = torch.matmul(new_state.to(C_h.dtype), C_h[..., None])[..., 0]  # b h p   h_t C_t
    if on_token is not None:
        new_state = on_token(0, new_state)  # what the next step continues from
    call.state.copy_(new_state)
    if call.D is not None:
        y = (y + x * call.D).to(y.dtype)
    if call.z is not None:
        y = y * F.silu(call.z)
    return y.to(x.dtype)
