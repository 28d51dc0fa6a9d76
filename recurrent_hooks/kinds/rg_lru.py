"""RecurrentGemma's RG-LRU (Griffin): the `RealGatedLinearRecurrence` mixer kind and its two token loops.

Glossary (code name, symbol in De et al., "Griffin: Mixing Gated Linear Recurrences with Local Attention
for Efficient Language Models", 2024, shape):
    batch            b                              batch size
    seq              t (a position), T              tokens of one call
    lru_width        D                              channels of the recurrence (`config.lru_width`)
    window           K - 1                          conv window width: `conv1d_width - 1` columns
    input_states     u_t   [batch, seq, hidden]     the block's input (after the temporal pre-norm)
    x_branch         W_x u_t  [batch, lru_width, seq]   the conv input, channel-major (`linear_x`)
    (conv output)    x_t   [batch, seq, lru_width]  Conv1D_K(W_x u)_t: the RG-LRU's input
    recurrent gate   r_t   [batch, seq, lru_width]  sigma(W_a x_t + b_a), block-diagonal per head
    input gate       i_t   [batch, seq, lru_width]  sigma(W_x' x_t + b_x'), block-diagonal per head
    recurrent_gate   a_t   [batch, seq, lru_width]  exp(-8 r_t softplus(recurrent_param)) in (0, 1]
                                                    (paper: a = sigma(Lambda)^(c r_t), c = 8); the kernel's
                                                    `recurrent_gate` argument is a_t, not r_t
    hidden_states    sqrt(1 - a_t^2) (i_t * x_t)  [batch, seq, lru_width]   the kernel's input: the gated input,
                                                    normalized; the factor is 1 where the sequence resets
    reset            -     [batch, seq, 1] bool     position_ids == 0: a_t := 0 there (a new sequence starts)
    state            h_t   [batch, lru_width]       float32 (`acc_dtype`), `rg_lru.recurrent_states`
    window           -     [batch, lru_width, K - 1]   the last K - 1 conv inputs, oldest first, model dtype,
                                                    `conv1d_state` of the block (transformers' own layout)

Recurrence, per channel (a diagonal linear recurrence; the kernel's output is the state itself):
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t * x_t),   a_t = 0 and the sqrt factor 1 where position_ids == 0
    y_t = h_t   (in the input's dtype); the block then returns W_out(y_t * GeLU(W_y u_t))

Where the memory lives: not in the transformers Cache, which holds only the attention layers, but on the
modules: `block.rg_lru.recurrent_states` and `block.conv1d_state`, reassigned by every forward. The
recurrence runs in the method `RecurrentGemmaRglru._rnn_scan` (a class attribute the library rebinds), one
method for prompts and one-token decode steps. The convolution is inline in
`RecurrentGemmaRecurrentBlock.forward`, so the library owns that forward as a second kernel: its loop is
transformers' forward, operation for operation, with the window handed to `on_token` after each token.

Rounding: both loops make transformers' own operations in its order and dtypes, so without writes they
equal transformers bit for bit (tests/kinds/test_rg_lru.py): the scan multiplies and adds in `acc_dtype` and
casts each output to the input's dtype; the conv of a prompt is transformers' one `conv_1d` call, and a
position whose window was written (or kept in grad mode) is recomputed as one `F.conv1d` over its window
(the same values to float32 precision); the decode step's product-and-sum is transformers'.

Module contents:
- `rnn_scan`: the loop of `RecurrentGemmaRglru._rnn_scan` (same signature and results, plus `on_token`);
- `recurrent_block_forward`: the loop of `RecurrentGemmaRecurrentBlock.forward` (the conv window);
- `RealGatedLinearRecurrence`: the mixer kind, after its adapter (`RealGatedLinearRecurrenceAdapter`).
"""

from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Bool, Float
from torch import Tensor, nn

from ..engine.declare.kernels import CONV_MEMORY, Kernel, Role, Site
from ..engine.declare.limits import Caveat, Refused
from ..engine.declare.loops import OnToken, handed_back_changed, version_of
from ..engine.errors import Unavailable
from ..engine.handle.adapter import KindAdapter
from ..engine.handle.mixer import RecurrentMixer
from ..engine.tracking.records import KernelCall


def rnn_scan(
    self: nn.Module,
    hidden_states: Float[Tensor, "batch seq lru_width"],
    recurrent_gate: Float[Tensor, "batch seq lru_width"],
    reset: Bool[Tensor, "batch seq 1"],
    recurrent_states: Float[Tensor, "batch lru_width"] | None,
    acc_dtype: torch.dtype = torch.float32,
    *,
    on_token: OnToken | None = None,
) -> tuple[Float[Tensor, "batch seq lru_width"], Float[Tensor, "batch lru_width"]]:
    """`RecurrentGemmaRglru._rnn_scan`, token by token: same arguments and results, plus `on_token`.

        out, last = rnn_scan(rg_lru, x, a, reset, h0)   # as rg_lru._rnn_scan(...)

    Returns every token's h_t in hidden_states' dtype and the last state in `acc_dtype`. One loop serves
    prompts and one-token decode steps (transformers branches on the length; both branches make these
    operations). `on_token(t, state)` is called after token t's update and output; token t+1 continues
    from the state it returns (or from the state it changed in place, as from a replacement: y_t is a copy),
    and the last one returned is the last state (the module keeps it).
    """
    a = recurrent_gate * ~reset  # b t D   a_t, 0 where a sequence starts (position 0)
    batch, seq, width = hidden_states.shape
    if recurrent_states is None:
        state = torch.zeros(batch, width, dtype=acc_dtype, device=hidden_states.device)  # b D   h_{-1} = 0
    else:
        state = recurrent_states.to(a.device)  # b D   the module's h, from the previous call
    outputs = []
    # one unbind of each input (a slice a token would make the backward quadratic in the tokens); the casts are
    # elementwise, so casting first gives each token's values
    gates, inputs = a.type(acc_dtype).unbind(1), hidden_states.type(acc_dtype).unbind(1)  # T x (b D) each
    for t in range(seq):
        state = gates[t] * state  # b D   a_t h_{t-1}
        state = state + inputs[t]  # b D   + sqrt(1 - a_t^2) (i_t * x_t)
        # b D   y_t = h_t, in the input's dtype: a tensor of its own (in float32 `.type` would return h_t itself,
        # and a hook that edits the state in place would edit token t's output too; a write is for tokens > t)
        outputs.append(state.to(hidden_states.dtype, copy=True))
        if on_token is not None:
            state = on_token(t, state)  # b D   what token t+1 continues from
    return torch.stack(outputs, dim=1), state


def recurrent_block_forward(
    self: nn.Module,
    input_states: Float[Tensor, "batch seq hidden"],
    position_ids: Tensor,
    attention_mask: Tensor | None = None,
    use_cache: bool = True,
    *,
    on_token: OnToken | None = None,
    **kwargs: Any,
) -> tuple[Float[Tensor, "batch seq hidden"], None]:
    """`RecurrentGemmaRecurrentBlock.forward`, with the conv window handed to `on_token` after each token.

    Same arguments, results and module updates as transformers' forward (5.24 and 5.25), its quirks included: a
    prefill (`position_ids` of more than one column) convolves from a zero window whatever the module
    holds; a one-token forward continues from `conv1d_state`; a fresh window is created with `hidden_size`
    channels; `use_cache=False` clears both memories. The window is `[batch, lru_width, conv1d_width - 1]`:
    the last inputs, oldest first. The window returned after the last token becomes `conv1d_state`
    (dropped with `use_cache=False`, as transformers drops it). The recurrence is the module's
    `rg_lru`, whose `_rnn_scan` the library rebinds separately.
    """
    _, seq_len, _ = input_states.shape
    batch_size = input_states.shape[0]

    y_branch = self.act_fn(self.linear_y(input_states))  # b T D   GeLU(W_y u)
    x_branch = self.linear_x(input_states).transpose(1, 2)  # b D T   W_x u, channel-major

    if use_cache:
        if self.conv1d_state is None or self.conv1d_state.shape[0] != batch_size:
            # transformers sizes a new window with hidden_size channels (a prefill replaces it)
            self.conv1d_state = torch.zeros(
                (batch_size, self.hidden_size, self.conv1d_width - 1),
                device=input_states.device,
                dtype=input_states.dtype,
            )
            self.rg_lru.recurrent_states = torch.zeros(
                (batch_size, self.lru_width), device=input_states.device, dtype=torch.float32
            )
        if position_ids.shape[1] != 1:  # prefill: from a zero window
            if on_token is None:
                self.conv1d_state = nn.functional.pad(x_branch, (self.conv1d_width - x_branch.shape[-1] - 1, 0))
                x_branch = self.conv_1d(x_branch)[..., :seq_len]
            else:
                x_branch, self.conv1d_state = _conv_prompt(self, x_branch, on_token)
        else:  # decoding: one token over the module's window
            conv_state = torch.cat((self.conv1d_state, x_branch), -1)  # b D K
            x_branch = torch.sum(conv_state * self.conv_1d.weight[:, 0, :], dim=-1) + self.conv_1d.bias
            x_branch = x_branch.unsqueeze(-1)
            window = conv_state[:, :, 1:]  # b D K-1   the window after the token
            self.conv1d_state = window if on_token is None else on_token(0, window)
    else:
        self.conv1d_state = None
        self.rg_lru.recurrent_states = None
        if on_token is None:
            x_branch = self.conv_1d(x_branch)[..., :seq_len]
        else:
            x_branch, _ = _conv_prompt(self, x_branch, on_token)

    x_branch = self.rg_lru(x_branch.transpose(1, 2), position_ids)

    hidden_states = x_branch * y_branch
    hidden_states = self.linear_out(hidden_states)
    return hidden_states, None


_CONTINUATION = Caveat(
    "transformers' RecurrentGemmaRecurrentBlock convolves a forward of several tokens from a zero window, even"
    " over a cached memory (its prefill branch): in a multi-token continuation the conv window restarts from"
    " zeros while h_t continues (the model's own behaviour, watched or not; the library's loop does the same,"
    " so the windows it hands over are those the model used). One token at a time (as generate does) is exact"
)
_ONE_TOKEN_PROMPT = Caveat(
    "the memory lives on module attributes and survives across calls: a one-token prompt (a new generate with"
    " the same batch size) convolves over the previous call's window, where a longer prompt starts from zeros"
    " (transformers' behaviour; h_t is reset by position 0). Watched, that call is call 0 all the same"
)
_WINDOW_CHANNELS = Refused(
    RuntimeError,
    "transformers creates a fresh conv window with hidden_size channels, not lru_width: with lru_width !="
    " hidden_size, a first cached forward of one token raises a size mismatch in transformers' forward, watched or"
    " not (the library's loop repeats it); a prompt of several tokens replaces the window with the right size",
)
_NO_SEGMENTS = Caveat(
    "_rnn_scan has no flag for its last state, so it does not run in segments: every call with hooks, writes"
    " or kept states runs the token loop (one cheap diagonal step per token)"
)
_PADDING = Caveat(
    "the block does not mask its conv input: in a left-padded batch the pads' W_x u enter the windows of a row's"
    " first K-1 real tokens (transformers' behaviour). h_t resets at position 0, which generate puts at the"
    " first real token (position_ids from the mask); a forward without position_ids counts from the first column"
)
_NOT_IN_CACHE = Caveat(
    "the memory is not in the transformers Cache (it holds the attention layers): after a call, read it from"
    " block.rg_lru.recurrent_states and block.conv1d_state, which the library's loops update as transformers"
    " does"
)
_BEAMS = Caveat(
    "transformers does not reorder this memory under beam search: generate reorders the Cache (the attention"
    " layers' rows) and RecurrentGemma has no _reorder_cache, so block.rg_lru.recurrent_states and"
    " block.conv1d_state stay in place and each row's h_t and window continue the same row, not its parent beam's"
    " (watched or not; the library runs exactly that). call.reorder stays None: every row continues itself"
)


class RealGatedLinearRecurrenceAdapter(KindAdapter):
    """RecurrentGemma's adapter: a forward's freshness read from the block (its memory is on the modules, not in the
    Cache), and its values."""

    def parse_forward(self, module: nn.Module, arguments: dict[str, Any]) -> tuple[int, Any, bool, Tensor]:
        """A call starts fresh when the block resets or drops its memory: `use_cache=False`, no window yet (or
        another batch size), or a position 0 among its position_ids (where the RG-LRU resets h_t)."""
        hidden = arguments[self.kind.FORWARD_INPUT]
        extra = arguments.get("kwargs", {})
        cache = arguments.get("cache", extra.get("cache"))
        position_ids = arguments.get("position_ids")
        window = module.conv1d_state
        fresh = (
            not arguments.get("use_cache", True)
            or window is None
            or window.shape[0] != hidden.shape[0]
            or position_ids is None
            or bool((position_ids == 0).any())
        )
        return hidden.shape[1], cache, fresh, hidden

    def cached(self, cache: Any, layer: int) -> Tensor | None:
        """Nothing: the transformers Cache holds no memory of this kind (it is on the modules)."""
        return None

    def token_values(self, mixer: RecurrentMixer, kernel_call: KernelCall) -> dict[str, Tensor]:
        x = kernel_call.inputs
        rows = x["hidden_states"].shape[0]
        reset = x["reset"].expand(rows, -1, -1)  # b t 1   one row per batch row (the kernel may get a shared one)
        return {
            "a": x["recurrent_gate"] * ~reset,
            "x": x["hidden_states"],
            "reset": reset[..., 0],
            "output": kernel_call.output["output"],
        }


class RealGatedLinearRecurrence(RecurrentMixer):
    """A Griffin recurrent block with its RG-LRU (recurrent_gemma).

        with recurrent_hooks.watch(model, keep=("states", "windows")) as w:
            model(input_ids)
        w.mixers[0].states        # Float[Tensor, "batch seq lru_width"]: h_t after every token
        w.mixers[0].windows   # Float[Tensor, "batch seq lru_width window"]: the last K-1 conv inputs

    The mixer module is `RecurrentGemmaRecurrentBlock` (it has no `layer_idx`: its layer is read from its
    path in the model). The state h_t is `[batch, lru_width]`, float32, kept on `block.rg_lru.recurrent_states`;
    the window is `[batch, lru_width, conv1d_width - 1]` in the model dtype, kept on `block.conv1d_state`.
    The recurrence kernel `_rnn_scan` is a method of `RecurrentGemmaRglru` (called from the block's
    submodule `rg_lru`) and returns the last state, which the module stores; the conv window is updated by
    the block's own forward, which the library owns as the conv kernel. A write at the last token of a
    call is what the next call continues from.
    """

    ADAPTER = RealGatedLinearRecurrenceAdapter
    KERNELS = (
        # prompts and decode steps alike; returns the last state, which the module stores
        Kernel(
            name="_rnn_scan",
            role=Role.BOTH,
            loop=rnn_scan,
            state_in="recurrent_states",
            results=("output", "final_state"),
            seq=("hidden_states", 1),
            site=Site.CLASS,
        ),
        # the block's forward, which the library owns: the conv window
        Kernel(
            name="forward",
            role=Role.BOTH,
            loop=recurrent_block_forward,
            memory=CONV_MEMORY,
            state_in=None,
            results=("output", "unused"),
            seq=("input_states", 1),
            site=Site.CLASS,
        ),
    )
    STATE = "batch lru_width"
    CONV_STATE = "batch lru_width window"
    FORWARD_INPUT = "input_states"
    REORDERED_BY_CACHE = False  # the memory is on the modules, which beam search's Cache reorder leaves (LIMITS)
    LEFT_PADDING = "positions"  # h_t resets at position id 0 (LIMITS["left padding"])
    INPUTS = {
        "hidden_states": "batch seq lru_width",
        "recurrent_gate": "batch seq lru_width",
        "reset": "rows seq 1  (position_ids == 0: one row when the batch shares its positions)",
        "recurrent_states": "batch lru_width",
    }
    OUTPUTS = {"output": "batch seq lru_width", "final_state": "batch lru_width"}
    VALUES = {
        "a": "batch seq lru_width",
        "x": "batch seq lru_width",
        "reset": "batch seq",
        "output": "batch seq lru_width",
    }
    LIMITS = {
        "multi-token continuation": _CONTINUATION,
        "one-token prompt": _ONE_TOKEN_PROMPT,
        "conv window channels": _WINDOW_CHANNELS,
        "segments and chunk-wise states": _NO_SEGMENTS,
        "left padding": _PADDING,
        "memory outside the Cache": _NOT_IN_CACHE,
        "beam search": _BEAMS,
        "effective attention": Refused(Unavailable, "not implemented for this kind (rh.effective_attention raises)"),
    }


def _conv_prompt(
    block: nn.Module, x: Float[Tensor, "batch lru_width seq"], on_token: OnToken
) -> tuple[Float[Tensor, "batch lru_width seq"], Float[Tensor, "batch lru_width window"]]:
    """The prompt's convolution from a zero window (as transformers' prefill), handing `on_token` the window
    after each token; returns the conv output (transformers' own `conv_1d` call, with the positions that read
    a written window recomputed) and the last window.

    A window `on_token` hands back as another tensor (a write, a replacing hook, or a kept window in grad
    mode, which the library reads through a leaf) feeds the next K-1 positions: each is recomputed as one
    `F.conv1d` over its window, so that the gradient with respect to a kept window is the effect of
    changing it there."""
    conv = block.conv_1d
    channels, length = x.shape[1], x.shape[2]
    out = conv(x)[..., :length]  # b D T   transformers' call: padding K-1, the first T positions
    window = x.new_zeros(x.shape[0], channels, block.conv1d_width - 1)  # b D K-1   zeros: a prefill starts empty
    dirty = 0  # how many more positions read a written window
    columns = x.unbind(-1)  # T x (b D)   one unbind: a slice a token would make the backward quadratic
    recomputed: dict[int, Tensor] = {}  # the positions that read a written window, put in once after the loop
    for t in range(length):
        full = torch.cat([window, columns[t][..., None]], dim=-1)  # b D K   the inputs position t reads
        if dirty:
            recomputed[t] = F.conv1d(full, conv.weight, conv.bias, groups=channels)[..., 0]  # b D
            dirty -= dirty > 0
        window = full[..., 1:]  # b D K-1   the window after token t
        version = version_of(window)
        written = on_token(t, window)  # b D K-1   what token t+1 shifts its input into
        if handed_back_changed(window, version, written):
            dirty = block.conv1d_width - 1  # positions t+1 .. t+K-1 read a column of it
        window = written
    if recomputed:  # one stack: transformers' columns where nothing was written, the recomputed ones elsewhere
        out = torch.stack([recomputed.get(t, column) for t, column in enumerate(out.unbind(-1))], dim=-1)
    return out, window
