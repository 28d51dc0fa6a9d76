"""Short convolutions: mixers whose only memory is the window of a short causal convolution.

Glossary (code name, symbol, shape as the kernels take it; `conv` has the window's mechanics):
    batch          b                                  batch size
    seq            t (a position)                     tokens of one call
    channels       c                                  the convolution's channels (one depthwise filter each)
    kernel_size    K                                  taps (`conv_L_cache` in lfm2/lfm3: 3, 7 at their defaults;
                                                      `conv_kernel_size` / `sconv_kernel_size` in inkling: 4)
    x              x_t       [batch, channels, seq]   the convolution's input, the `hidden_states` of
                                                      `causal_conv1d_fn` / `causal_conv1d_update`
    weight         w         [channels, kernel_size]  w[:, K - 1] multiplies the newest input
    window         -         [batch, channels, K]     `conv_state`: the last K inputs, oldest first, the layout
                                                      and dtype of transformers' cache; the whole memory
    output         -         [batch, channels, seq]   DWConv_K(x)_t = sum_k w[:, k] window_t[:, k] (+ bias)

What the window holds, per family (docs/concepts.md, "Short convolutions"; tests/kinds/test_short_conv.py checks
each equation in float64):
    lfm2, lfm2_moe, lfm3   [B; C; x~] = W_in h;  y = W_out(C ⊙ DWConv_K(B ⊙ x~))    the window holds B ⊙ x~
                           (channels = hidden_size), in the model dtype
    inkling                y = x + DWConv_K(x)                                        the window holds x, fp32
    inkling2, inkling2_loop (static)  y = (x + DWConv_K(x)) / sqrt(K + 1)             the window holds x, fp32

Inkling runs four such convolutions in every decoder layer, each a mixer of its own, in module order:
`self_attn.k_sconv` (cache state 0, over the keys, `[batch, kv_heads * head_dim, K]`), `self_attn.v_sconv`
(state 1, the values), `attn_sconv` (state 2, after attention, `[batch, hidden, K]`) and `mlp_sconv`
(state 3, after the MLP). They share the cache layer `layer_idx` and are told apart by the module's
`conv_idx`, the cache's `state_idx`. inkling2 names them `self_attn.{k,v}_proj.sconv`,
`post_attention_convolution` and `post_mlp_convolution`; in its full-attention layers the k and v
convolutions are dynamic (`Inkling2DynamicShortConvolution`, an inline unfold: the `dynamic_conv` kinds, which
own that forward).

inkling2_loop runs its loop layers (`loop_layer_index_start` .. `loop_layer_index_end - 1`) `loop_num_passes`
times per forward, the same module each time, each pass on its own cache layer: pass 0 on `layer_idx`, pass
p > 0 on `layer_idx + cache_offset_p`, cache_offset_p = num_hidden_layers + (p - 1) * n_loop - loop_start
(the forward's `cache_offset` argument). A watch makes one mixer per pass of such a module
(`LoopedShortConvolution`), each counting its own pass's forwards: its prompt is call 0 and decode step k
is call k, as for every mixer. `mix.cache_index` = (cache layer, state index) says which pass it is.

Module contents:
- `ShortConvolution`: the mixer kind (its kernels are `conv.CONV_KERNELS`, shared with every kind), after its
  adapter (`ShortConvolutionAdapter`: where a window is in the cache, the values).
- `LoopedShortConvolution`: inkling2_loop's, with a mixer per pass of a looped module (`LoopedShortConvolutionAdapter`).
"""

import warnings
import weakref
from typing import Any, ClassVar

from einops import rearrange
from torch import Tensor, nn

from ..engine.declare.kernels import CONV_MEMORY
from ..engine.declare.limits import Caveat, Refused
from ..engine.errors import RecurrentHooksError, RecurrentHooksWarning, Unavailable
from ..engine.handle.adapter import KindAdapter
from ..engine.handle.mixer import RecurrentMixer
from ..engine.tracking.records import KernelCall
from .shared.conv import CONV_KERNELS


class ShortConvolutionAdapter(KindAdapter):
    """A short convolution's adapter: its window's place in the cache (a cache layer holds several), and its
    values."""

    def cache_index(self, module: nn.Module, arguments: dict[str, Any]) -> tuple[int, int] | None:
        """`(cache layer, state index)` of this forward's window."""
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            return None
        name = self.kind.CACHE_OFFSET
        offset = arguments.get(name, arguments.get("kwargs", {}).get(name, 0))
        return layer + offset, getattr(module, self.kind.STATE_INDEX, 0)

    def cached_window(self, cache: Any, where: tuple[int, int]) -> Tensor | None:
        layer, state = where
        return cache.get_conv_state(layer, state_idx=state)

    def token_values(
        self, mixer: RecurrentMixer, kernel_call: KernelCall, tokens: int | None = None
    ) -> dict[str, Tensor]:
        inputs, output = kernel_call.inputs, kernel_call.output
        if inputs is None or output is None:
            raise Unavailable(
                f"{self.kind.__name__}.values: the kernel {'inputs' if inputs is None else 'outputs'}"
                " were not kept: pass keep=('inputs', 'outputs') to watch"
            )
        x, out = inputs["hidden_states"], output["output"]
        seq = x.shape[-1] if tokens is None else tokens  # a prompt over a cache: the cached window comes first
        return {"x": rearrange(x[..., -seq:], "b c t -> b t c"), "output": rearrange(out[..., -seq:], "b c t -> b t c")}


class ShortConvolution(RecurrentMixer):
    """A short causal convolution whose window is the mixer's whole memory (lfm2, lfm2_moe, lfm3, inkling, inkling2).

    (inkling2_loop's is `LoopedShortConvolution`, which adds a mixer per pass of a looped layer.)

        with recurrent_hooks.watch(model, keep=("windows",)) as w:
            model(input_ids)
        mix = w.mixers[0]
        mix.windows                          # Float[Tensor, "batch seq channels kernel_size"]
        mix.set_window_after(4, window)      # (in a new watch) tokens 5.. and the cache read `window`

    There is no recurrent state: `state_after`, `states` and `set_state_after` raise `Unavailable`, and
    `register_state_hook` hooks the window (`memory="window"`, the default for this kind). The window
    after token t is what tokens t+1..t+K-1 read, so writing it after t makes the convolution's outputs
    after t those of the run it came from: for a short convolution the window is the whole memory.

    Where a module's window lives in the cache: layer `layer_idx + cache_offset` (the forward's
    `CACHE_OFFSET` argument, 0 when absent), state `STATE_INDEX` (the module's attribute, 0 when absent).
    """

    ADAPTER = ShortConvolutionAdapter
    KERNELS = CONV_KERNELS
    MEMORIES = (CONV_MEMORY,)
    CONTINUES_CACHE = True  # the cached window comes before the call's inputs
    STATE = ""  # no recurrent state
    CONV_STATE = "batch channels kernel_size"
    INPUTS = {
        "hidden_states": "batch channels seq  (the convolution's input x; lfm: B ⊙ x~, inkling: x)",
        "conv_state": "batch channels kernel_size  (decode: the cached window, updated in place)",
        "weight": "channels kernel_size",
        "bias": "channels  (or None)",
    }
    OUTPUTS = {"output": "batch channels seq  (DWConv_K(x), before the family's gate or residual)"}
    VALUES = {
        "x": "batch seq channels  (the convolution's input at each token: the window's newest column)",
        "output": "batch seq channels  (DWConv_K(x) at each token, before the family's gate or residual)",
    }
    LIMITS = {
        "state": Refused(
            Unavailable,
            "a short convolution carries no recurrent state: its whole memory is the window (windows);"
            " reading, writing or hooking a state raises",
        ),
        "effective attention, patching_sweep(memory='state')": Refused(
            Unavailable,
            "both need a recurrent state; patching_sweep(memory=None | 'window') patches the windows"
            " (the whole memory here), and attribute estimates them (its state rows are zero)",
        ),
        "packed sequences": Refused(
            (ValueError, RecurrentHooksError),
            "a packed batch (seq_idx): transformers' convolution keeps its sequences apart with the causal_conv1d"
            " package and raises ValueError without it, and so does an idle watched call; a call with hooks, writes"
            " or kept windows raises RecurrentHooksError (the library's loop runs one sequence per batch row)",
        ),
    }
    FORWARD_CACHE = ("cache", "past_key_values")
    STATE_INDEX: ClassVar[str] = "conv_idx"  # the module attribute naming its window among the cache layer's
    CACHE_OFFSET: ClassVar[str] = "cache_offset"  # the forward argument added to layer_idx (inkling2's loop)

    def values(self, call: int | None = None) -> dict[str, Tensor]:
        """The convolution's input and output at every token of call `call` (default: the last), token-major.

        with rh.watch(model, keep=("inputs", "outputs")) as w:
            model(ids)
        w.mixers[0].values()["x"]      # [batch, seq, channels]: what each token shifts into the window
        """
        record = self._call(call, "values")
        if record.conv is None:
            raise Unavailable(f"{self}: call {record.index} made no convolution kernel call")
        return self.adapter.token_values(self, record.conv, record.tokens)


class LoopedShortConvolutionAdapter(ShortConvolutionAdapter):
    """inkling2_loop's: a handle per pass of a looped module (`instances`), each serving its own pass's forwards."""

    def __init__(self, kind: "type[LoopedShortConvolution]") -> None:
        super().__init__(kind)
        self.warned: weakref.WeakSet[RecurrentMixer] = weakref.WeakSet()  # the handles that said they skipped a pass

    def instances(self, module: nn.Module, model: nn.Module) -> tuple[Any, ...]:
        config = getattr(model, "config", None)
        config = config.get_text_config() if config is not None else None
        start, end, passes = (getattr(config, name, None) for name in self.kind.LOOP_CONFIG)
        layer = getattr(module, "layer_idx", None)
        if None in (start, end, passes, layer) or not start <= layer < end:
            return (None,)  # not looped: one mixer, every forward
        state = getattr(module, self.kind.STATE_INDEX, 0)
        offsets = [0] + [config.num_hidden_layers + (p - 1) * (end - start) - start for p in range(1, passes)]
        return tuple((layer + offset, state) for offset in offsets)

    def serves(self, mixer: RecurrentMixer, forward: Any) -> bool:
        """A watch's mixer serves its own pass. A hook registered without a watch cannot tell the passes apart
        (they come from the model's config): it serves the first pass, and a later pass runs as transformers runs
        it, unhooked and uncounted, with one warning per handle (a watch has a mixer per pass)."""
        index = forward.cache_index
        if mixer.cache_index is None and index is not None and index[0] != mixer.layer:
            if mixer not in self.warned:
                self.warned.add(mixer)
                warnings.warn(
                    f"{mixer}: a later pass of a looped layer (cache layer {index[0]}) ran without this"
                    " hook, which was registered without a watch and serves the first pass only; watch"
                    " the model for a mixer per pass",
                    RecurrentHooksWarning,
                    stacklevel=2,
                )
            return False
        return super().serves(mixer, forward)


class LoopedShortConvolution(ShortConvolution):
    """inkling2_loop's short convolutions: a looped layer's module runs once per pass, and has a mixer per pass.

        with recurrent_hooks.watch(model, keep=("windows",)) as w:
            model.generate(input_ids, max_new_tokens=4)
        [(m.layer, m.cache_index) for m in w.mixers]   # a looped layer's modules twice: (layer, i) and (cache layer, i)
        w.mixers[5].calls[1]                     # decode step 1 of that mixer's own pass

    The passes of a module are told apart by the cache layer the forward uses (`layer_idx + cache_offset`):
    a mixer takes part in its own pass's forwards only. The passes come from the model's config (the
    `LOOP_CONFIG` fields), so only a watch knows them: a hook registered on a looped module without a watch
    (`rh.register_state_hook`) serves the first pass; the later passes run unhooked, with one warning.
    """

    ADAPTER = LoopedShortConvolutionAdapter
    LOOP_CONFIG: ClassVar[tuple[str, str, str]] = ("loop_layer_index_start", "loop_layer_index_end", "loop_num_passes")
    LIMITS = {
        **ShortConvolution.LIMITS,
        "hooks without a watch on a looped module": Caveat(
            "rh.register_state_hook cannot tell the passes apart (they come from the model's config): it serves the"
            " first pass, the later passes run unhooked (one warning); watch the model for a mixer per pass"
        ),
    }

    def __repr__(self) -> str:
        if self.cache_index is None or self.cache_index[0] == self.layer:
            return super().__repr__()
        return f"{type(self).__name__}({self.family}, layer {self.layer}, cache layer {self.cache_index[0]})"
