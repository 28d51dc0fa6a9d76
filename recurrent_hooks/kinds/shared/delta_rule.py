"""The gated delta rule's maths, shared by the kinds that run it (`GatedDeltaNet`, `KimiDeltaAttention`).

Glossary and recurrence: `gated_delta_net`'s module docstring (Yang, Kautz & Hatamizadeh, "Gated Delta Networks",
2024); Kimi delta attention's per-channel decay (`kimi=True`) is `kimi_delta`'s. Per value head:
    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,   o_t = S_t^T q_t

Module contents:
- `prepare`: the kernels' arguments as the loops take them (normalised, scaled, grouped heads repeated).
- `gated_delta_rule`: the token loop (prompt and decode kernels alike), with `on_token`.
- `gated_delta_rule_states`: every token's state chunk-wise (into `out`, or a chunk at a time to `on_chunk`; exact
  linear readouts from `factors`), `ROW_STEPS_FROM` choosing how a chunk's states are formed.
- `gated_delta_rule_adjoint`: the adjoint recurrence, right to left (`Segments.adjoint`).
- `kernels`: a delta-rule kind's four kernels with transformers' signatures, written once (`KernelSet`).
- `cost_shape`: a prompt call's shape for the cost model.
"""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from einops import repeat
from jaxtyping import Float
from torch import Tensor

from ...engine.declare.loops import (
    OnChunk,
    OnToken,
    Visit,
    causal_decay,
    chunk_formed,
    flushed_exp,
    plus,
    rank_one_steps,
    refuse_packed,
    scratch_like,
    starting_state,
    states_buffer,
    times,
    visited,
)
from ...engine.paths.costs import Shape


def prepare(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    kwargs: dict[str, Any],
    kimi: bool = False,
    recurrent: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k, v, beta, log-decay (float32, token-major, one key head per value head) and the starting state.

    g is the log decay per head (`[.., heads, 1]`: gated DeltaNet, whose wrappers add the axis) or per key
    channel (`[.., heads, key_dim]`: Kimi delta attention); exp(g) scales the rows of the key-major state.
    The normalisation and the 1/sqrt(d_k) scaling are written as transformers writes them, so that the
    roundings are the same: gated DeltaNet multiplies by rsqrt(|x|^2 + eps) and its decode kernel
    divides by sqrt(d_k) (its prompt kernel, `recurrent=False`, multiplies by d_k ** -0.5); Kimi delta
    attention (`kimi`) divides by sqrt(|x|^2 + eps) and multiplies by 1 / sqrt(d_k).
    """
    refuse_packed(kwargs, ("cu_seqlens",), "flash-linear-attention")
    batch, _, key_heads, key_dim = key.shape
    heads, value_dim = value.shape[-2:]
    # grouped value heads: value head j reads key head j // (heads // key_heads)
    query, key = (repeat(x, "b t kh d -> b t (kh g) d", g=heads // key_heads) for x in (query, key))
    # token-major copies: the mixers hand over views whose token axis is the fastest (a conv output transposed),
    # which makes every per-token step of the loop a strided gather (docs/performance.md, "The path benchmark")
    q, k, v, b, log_a = (x.to(torch.float32).contiguous() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        if kimi:
            q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        else:
            q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    if kimi:
        q = q * (1 / key_dim**0.5)
    elif recurrent:
        q = q / key_dim**0.5
    else:
        q = q * key_dim**-0.5
    state = starting_state(initial_state, lambda: q.new_zeros(batch, heads, key_dim, value_dim))
    return q, k, v, b, log_a, state


def gated_delta_rule(
    query: Float[Tensor, "batch seq key_heads key_dim"],
    key: Float[Tensor, "batch seq key_heads key_dim"],
    value: Float[Tensor, "batch seq heads value_dim"],
    g: Float[Tensor, "batch seq heads decay_dim"],
    beta: Float[Tensor, "batch seq heads"],
    initial_state: Float[Tensor, "batch heads key_dim value_dim"] | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    on_token: OnToken | None,
    kwargs: dict[str, Any],
    kimi: bool = False,
) -> tuple[Float[Tensor, "batch seq heads value_dim"], Float[Tensor, "batch heads key_dim value_dim"] | None]:
    """The token loop, in float32 and with the ops of transformers' decode kernels (products summed over
    key_dim, not matmuls), so that a half-precision model rounds its output as transformers does."""
    q, k, v, b, log_a, state = prepare(
        query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel, kwargs, kimi=kimi
    )
    a = log_a.exp()
    outputs = []
    scratch = scratch_like(state)  # b h k v   each token's products (None with gradients)
    # per token from one unbind each (under autograd a slice's backward is a gradient of the whole tensor, per
    # token), with the axes the products broadcast over added once: q, k [b h k 1], b [b h 1], a [b h (1|k) 1]
    steps = zip(*(x.unbind(1) for x in (q[..., None], k[..., None], v, b[..., None], a[..., None])))
    for t, (q_t, k_t, v_t, b_t, a_t) in enumerate(steps):
        state = state * a_t  # b h k v   decay: diag(a_t) S_{t-1} (a new tensor)
        kv_mem = times(state, k_t, scratch).sum(-2)  # b h v   what S stores under k_t
        delta = (v_t - kv_mem) * b_t  # b h v   b_t (v_t - S^T k_t)
        state = plus(state, times(k_t, delta[:, :, None, :], scratch), scratch is not None)  # b h k v   S + k_t delta^T
        outputs.append(times(state, q_t, scratch).sum(-2))  # b h v   o_t = S_t^T q_t
        if on_token is not None:
            state = on_token(t, state)  # b h k v   what token t+1 continues from
    out = torch.stack(outputs, dim=1) if outputs else v.new_zeros(*v.shape)
    return out.to(query.dtype), (state if output_final_state else None)


ROW_STEPS_FROM = 65_536  # state elements from which a chunk's states are formed token by token (measured on a CPU:
# docs/performance.md, "Performance, third round")


def _decayed_products(left: Tensor, right: Tensor, decay: Tensor) -> Float[Tensor, "i j batch heads"]:
    """left_i^T D_ij right_j for every pair of a chunk's tokens: left `[i, batch, heads, key_dim]`, right `[j, batch,
    heads, key_dim]`, decay D_ij `[i, j, batch, heads, d]`. With one decay per head (d = 1) it scales the products
    of one batched matmul (faster than the elementwise form: docs/performance.md, "Keeping a per-token reduction");
    with one per key
    channel (d = key_dim), the elementwise products are summed."""
    if decay.shape[-1] == 1:
        return torch.einsum("ibhk,jbhk->ijbh", left, right) * decay[..., 0]
    return (left[:, None] * decay * right[None]).sum(-1)


def gated_delta_rule_states(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    kwargs: dict[str, Any],
    chunk: int = 16,
    kimi: bool = False,
    out: Tensor | None = None,
    on_chunk: OnChunk | None = None,
    factors: tuple[Tensor, Tensor] | None = None,
) -> tuple[tuple[Tensor, Tensor | None], Float[Tensor, "seq batch heads key_dim value_dim"] | None]:
    """The same recurrence, chunk by chunk, returning every token's state too.

    Inside a chunk starting from S_0, with c_i the cumulative log decay from the chunk start to token i
    and D_ij = diag(exp(c_i - c_j)) for j <= i (the decay from token j to token i, at most 1), the corrections
    u_i each token writes (b_i (v_i - what the decayed state stores under k_i), as in the token loop) solve
        u_i + b_i sum_{j<i} (k_i^T D_ij k_j) u_j = b_i (v_i - S_0^T diag(exp(c_i)) k_i)
    the outputs come from the chunk's attention form, which reads no state,
        o_i = S_0^T diag(exp(c_i)) q_i + sum_{j<=i} (q_i^T D_ij k_j) u_j
    and the states are formed token by token from the corrections, S_i = diag(a_i) S_{i-1} + k_i u_i^T
    (`loops.rank_one_steps`: two passes over a state a token, each written once where it is kept). Below
    `ROW_STEPS_FROM` state elements (batch included), a chunk's states are formed at once instead
    (`_states_at_once`), S_i = diag(exp(c_i)) S_0 + sum_{j<=i} D_ij k_j u_j^T (a product of inner size chunk), and
    read for the outputs, o_i = S_i^T q_i: there the per-token steps' Python calls cost more than the product, which
    CPUs run far below their speed on large states (docs/performance.md, "Performance, third round").

    The states go into one token-first buffer (`out`, float32, when given: a buffer reused across calls is not paged
    in again, which a fresh one of this size is on CPU). With `on_chunk`, each chunk's states go to
    `on_chunk(start, states)` instead, in one buffer of one chunk reused by the next (`Segments.on_chunk`), and None
    is returned for them: a reduction of every state holds one chunk of states, whatever the length. With `factors`
    (a, b) too, `on_chunk` gets each chunk's linear readouts `[size, batch, heads, r]` instead, formed without the
    states (`_chunk_readouts`).
    """
    q, k, v, b, log_a, state = prepare(
        query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel, kwargs, kimi=kimi, recurrent=False
    )
    q, k, v, b, log_a = (x.movedim(1, 0) for x in (q, k, v, b, log_a))  # token first: t b h ..
    shape = (*q.shape[:3], q.shape[-1], v.shape[-1])
    if on_chunk is not None:  # one chunk's, reused (none for readouts)
        every = q.new_empty(0 if factors is not None else min(chunk, shape[0]), *shape[1:])  # i b h k v
    else:
        every = q.new_empty(shape) if out is None else states_buffer(out, shape)  # t b h k v
    out = v.new_empty(v.shape)  # t b h v
    row_steps = factors is not None or math.prod(shape[1:]) >= ROW_STEPS_FROM
    for start in range(0, q.shape[0], chunk):
        qc, kc, vc, bc, gc = (x[start : start + chunk] for x in (q, k, v, b, log_a))  # i b h ..
        size = qc.shape[0]
        cum = gc.cumsum(0)  # i b h d   c_i, d = 1 or key_dim
        decay = causal_decay(cum)  # i j b h d   D_ij
        interaction = _decayed_products(kc, kc, decay) * bc[:, None]  # i j b h   b_i k_i^T D_ij k_j
        system = torch.eye(size, device=q.device) + interaction.permute(2, 3, 0, 1).tril(-1)  # b h i j
        # (b h batches: broadcasting S_0 over the chunk's tokens would copy it once per token)
        reads = ((kc * flushed_exp(cum)).permute(1, 2, 0, 3) @ state).permute(
            2, 0, 1, 3
        )  # i b h v   S_0^T diag(exp(c_i)) k_i
        rhs = (bc[..., None] * (vc - reads)).permute(1, 2, 0, 3)  # b h i v
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # b h j v
        states = every[start : start + size] if on_chunk is None else every[:size]  # i b h k v   (readouts: none)
        if row_steps:
            scores = _decayed_products(qc, kc, decay).permute(2, 3, 0, 1)  # b h i j   q_i^T D_ij k_j
            from_start = (qc * flushed_exp(cum)).permute(1, 2, 0, 3) @ state  # b h i v   S_0^T diag(exp(c_i)) q_i
            out[start : start + size] = (scores @ u + from_start).permute(2, 0, 1, 3)  # i b h v   o_i = S_i^T q_i
            if factors is not None:
                readouts, state = _chunk_readouts(factors, state, cum, decay, kc, u)  # i b h r, b h k v
                on_chunk(start, readouts)
                continue
            # S_i = diag(a_i) S_{i-1} + k_i u_i^T
            rank_one_steps(states, state, flushed_exp(gc), kc, u.permute(2, 0, 1, 3))  # i b h k v
        else:
            out[start : start + size] = _states_at_once(states, state, cum, decay, kc, u, qc)  # i b h v
        state = chunk_formed(states, start, on_chunk)  # b h k v
    result = (out.movedim(0, 1).to(query.dtype), state if output_final_state else None)
    return result, (every if on_chunk is None else None)


def _states_at_once(
    states: Tensor, state: Tensor, cum: Tensor, decay: Tensor, keys: Tensor, u: Tensor, queries: Tensor
) -> Float[Tensor, "i batch heads value_dim"]:
    """A chunk's states into `states` `[i, batch, heads, key_dim, value_dim]` by one product, S_i = diag(exp(c_i)) S_0
    + sum_{j<=i} D_ij k_j u_j^T, and the outputs o_i = S_i^T q_i read from them (small states: `ROW_STEPS_FROM`).
    S_0 `state`, c `cum` `[i, b, h, d]`, D `decay` `[i, j, b, h, d]`, k `keys` and q `queries` `[., b, h, key_dim]`,
    u `[b, h, j, value_dim]`."""
    decayed_keys = decay * keys[None]  # i j b h k   D_ij k_j
    torch.matmul(decayed_keys.permute(0, 2, 3, 4, 1), u, out=states)  # sum_j D_ij k_j u_j^T
    states.addcmul_(flushed_exp(cum)[..., None], state)  # + diag(exp(c_i)) S_0
    return (queries[..., None, :] @ states).squeeze(-2)  # i b h v   o_i = S_i^T q_i


def _chunk_readouts(
    factors: tuple[Tensor, Tensor], state: Tensor, cum: Tensor, decay: Tensor, keys: Tensor, u: Tensor
) -> tuple[Float[Tensor, "i batch heads r"], Float[Tensor, "batch heads key_dim value_dim"]]:
    """A chunk's rank-r linear readouts sum_r a_r^T S_i b_r per head, and its last state, without forming the
    states S_0 .. S_{size-1} in between (the probe `rh.probe(a, b)` at the cost of a query):
        a^T S_i b = (a * exp(c_i))^T S_0 b + sum_{j<=i} (a^T D_ij k_j) (u_j^T b)
        S_last = diag(exp(c_last)) S_0 + sum_j D_last,j k_j u_j^T
    a `[heads, r, key_dim]`, b `[heads, r, value_dim]`; S_0 `state` `[batch, heads, key_dim, value_dim]`; c `cum`
    `[i, batch, heads, d]`, D `decay` `[i, j, batch, heads, d]` (d = 1 or key_dim); k `keys` `[j, batch, heads,
    key_dim]`; u `[batch, heads, j, value_dim]`. Costs chunk^2 r key_dim + chunk r value_dim per chunk and head, and
    key_dim value_dim per token for the last state (forming every state costs 2 key_dim value_dim per token)."""
    a, b = factors
    grow = flushed_exp(cum).expand(*cum.shape[:3], keys.shape[-1])  # i b h k   exp(c_i)
    start_b = torch.einsum("bhkv,hrv->bhkr", state, b)  # b h k r   S_0 b_r
    readouts = torch.einsum("ibhk,hrk,bhkr->ibhr", grow, a, start_b)  # i b h r   (a exp(c_i))^T S_0 b
    written = torch.einsum("bhjv,hrv->jbhr", u, b)  # j b h r   u_j^T b_r
    if decay.shape[-1] == 1:  # one decay per head: it scales the products
        reads = torch.einsum("hrk,jbhk->jbhr", a, keys)[None] * decay  # i j b h r   a_r^T D_ij k_j
    else:
        reads = torch.einsum("hrk,ijbhk,jbhk->ijbhr", a, decay, keys)  # i j b h r
    readouts = readouts + (reads * written[None]).sum(1)  # i b h r
    last = grow[-1][..., None] * state + torch.einsum("jbhk,bhjv->bhkv", decay[-1] * keys, u)  # b h k v
    return readouts, last


def gated_delta_rule_adjoint(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    use_qk_l2norm_in_kernel: bool,
    grad_output: Tensor | None,
    grad_final: Tensor | None,
    visit: Visit,
    kwargs: dict[str, Any],
    kimi: bool = False,
) -> Float[Tensor, "batch heads key_dim value_dim"]:
    """The adjoint of the prompt recurrence, right to left (`Segments.adjoint`): with mu_t = d m / d S_t
    through the tokens after t (mu_{T-1} the final state's gradient) and dO_t the output's gradient,
        mu_{t-1} = D_t (I - b_t k_t k_t^T) (mu_t + q_t dO_t^T)      (D_t = diag(a_t); a scalar for gated DeltaNet)
    the transpose of S_t = (I - b_t k_t k_t^T) D_t S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t. Calls
    `visit(t, mu_t)` at each token and returns mu_{-1}, the initial state's gradient. q and k as the prompt
    kernel forms them (`prepare(recurrent=False)`); float32."""
    q, k, _, b, log_a, state = prepare(
        query, key, value, g, beta, initial_state, use_qk_l2norm_in_kernel, kwargs, kimi=kimi, recurrent=False
    )
    a = log_a.exp()  # b t h (1|k)
    mu = state.new_zeros(state.shape) if grad_final is None else grad_final.to(torch.float32, copy=True)
    grad_output = None if grad_output is None else grad_output.to(torch.float32)
    written = (b[..., None] * k).unsqueeze(-1)  # b t h k 1   b_t k_t
    for t in reversed(range(q.shape[1])):
        mu = visited(visit, t, mu)  # b h k v   mu_t: what a change of the state after token t does to m
        # (in place from here: mu is this loop's own tensor, which `visit` does not keep)
        if grad_output is not None:
            mu.addcmul_(q[:, t, :, :, None], grad_output[:, t, :, None, :])  # b h k v   + q_t dO_t^T
        read = k[:, t, :, None, :] @ mu  # b h 1 v   k_t^T mu
        mu.addcmul_(written[:, t], read, value=-1).mul_(a[:, t, :, :, None])  # b h k v   D_t (I - b_t k_t k_t^T) mu
    return mu


class KernelSet(NamedTuple):
    """A delta-rule kind's four kernels with transformers' signatures (`kernels`)."""

    prompt: Callable[..., Any]  # the prompt kernel token by token (`Kernel.loop`)
    states: Callable[..., Any]  # its chunk-wise all-states version (`Segments.all_states`)
    adjoint: Callable[..., Any]  # its adjoint recurrence (`Segments.adjoint`)
    decode: Callable[..., Any]  # the decode kernel, plus `on_token`


def kernels(prompt_name: str, decode_name: str, module: str, kimi: bool = False) -> KernelSet:
    """A delta-rule kind's kernels, their signatures written once: the prompt kernel's is transformers' chunked
    kernel's (`prompt_name`; `chunk_size` accepted and ignored), the decode kernel's its recurrent kernel's
    (`decode_name`), each with keyword-only extras (`on_token(t, state)`, called after each token's state update and
    returning the state token t+1 continues from; the all-states version's `out`, `on_chunk` and `factors`; the
    adjoint's `grad_output`, `grad_final` and `visit`). Unknown keyword arguments are ignored. The decay g is per
    head (`[batch, seq, heads]`: gated DeltaNet) or, with `kimi`, per key channel (`[batch, seq, heads, key_dim]`).
    The functions are named as the kind's module exports them (`module`)."""

    def decay(g: Tensor) -> Tensor:
        return g if kimi else g[..., None]

    def prompt(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        g: Tensor,
        beta: Tensor,
        chunk_size: int = 64,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        *,
        on_token: OnToken | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        return gated_delta_rule(
            query,
            key,
            value,
            decay(g),
            beta,
            initial_state,
            output_final_state,
            use_qk_l2norm_in_kernel,
            on_token,
            kwargs,
            kimi=kimi,
        )

    def states(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        g: Tensor,
        beta: Tensor,
        chunk_size: int = 64,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        *,
        out: Tensor | None = None,
        on_chunk: OnChunk | None = None,
        factors: tuple[Tensor, Tensor] | None = None,
        **kwargs: Any,
    ) -> tuple[tuple[Tensor, Tensor | None], Tensor | None]:
        return gated_delta_rule_states(
            query,
            key,
            value,
            decay(g),
            beta,
            initial_state,
            output_final_state,
            use_qk_l2norm_in_kernel,
            kwargs,
            kimi=kimi,
            out=out,
            on_chunk=on_chunk,
            factors=factors,
        )

    def adjoint(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        g: Tensor,
        beta: Tensor,
        chunk_size: int = 64,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        *,
        grad_output: Tensor | None,
        grad_final: Tensor | None,
        visit: Visit,
        **kwargs: Any,
    ) -> Tensor:
        return gated_delta_rule_adjoint(
            query,
            key,
            value,
            decay(g),
            beta,
            initial_state,
            use_qk_l2norm_in_kernel,
            grad_output,
            grad_final,
            visit,
            kwargs,
            kimi=kimi,
        )

    def decode(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        g: Tensor,
        beta: Tensor,
        initial_state: Tensor | None = None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        *,
        on_token: OnToken | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        return gated_delta_rule(
            query,
            key,
            value,
            decay(g),
            beta,
            initial_state,
            output_final_state,
            use_qk_l2norm_in_kernel,
            on_token,
            kwargs,
            kimi=kimi,
        )

    docs = {
        prompt: "The prompt kernel, token by token: same arguments and results as transformers' chunked kernel,"
        " plus `on_token` (`delta_rule.kernels`).",
        states: f"`{prompt_name}`'s results and every token's state, token first `[seq, batch, heads, key_dim,"
        " value_dim]`, chunk-wise: into `out`, or a chunk of 16 tokens at a time to `on_chunk` (then"
        " None: `Segments.on_chunk`).",
        adjoint: f"`{prompt_name}`'s adjoint recurrence (`gated_delta_rule_adjoint`), with its arguments.",
        decode: "The decode kernel: same arguments and results as transformers' recurrent kernel, plus `on_token`.",
    }
    names = {
        prompt: prompt_name,
        states: f"{prompt_name}_states",
        adjoint: f"{prompt_name}_adjoint",
        decode: decode_name,
    }
    for fn, name in names.items():
        fn.__name__ = fn.__qualname__ = name
        fn.__module__, fn.__doc__ = module, docs[fn]
    return KernelSet(prompt, states, adjoint, decode)


def cost_shape(arguments: dict[str, Any]) -> Shape:
    """The prompt kernel call's shape for the cost model (`engine.paths.costs`): transformers' kernel pads to chunks
    of 64. Its footprint, measured at Qwen3.5 dims (tests/engine/test_path_memory.py): the kernel's graph GRAPH per
    chunk unit, the token loop's LOOP_GRAPH states a token under autograd."""
    batch, _, heads, value_dim = arguments["value"].shape
    return Shape(
        "delta rule",
        batch,
        heads,
        arguments["key"].shape[-1],
        value_dim,
        arguments.get("chunk_size", 64),
        graph=GRAPH,
        loop_graph=LOOP_GRAPH,
    )


GRAPH, LOOP_GRAPH = 2.6, 2.1  # above the measured footprint (docs/performance.md, "Paths chosen by memory")
