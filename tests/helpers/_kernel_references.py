"""The float64 states of one recorded kernel call, per kind, from its kept inputs (`keep=("inputs",)`): the
references (tests/helpers/_reference.py, _reference_ssm.py) run on what the kernel really received.

    REFERENCES[type(mixer)](mixer.calls[k].kernel_calls[0])   # [batch, tokens, *state], float64
"""

import math

from _reference import gated_delta_rule_reference, kimi_delta_rule_reference
from _reference_ssm import selective_scan_reference, ssd_reference

import recurrent_hooks as rh


def gated_delta_part(part):
    x = part.inputs
    reference = gated_delta_rule_reference if x["g"].dim() == 3 else kimi_delta_rule_reference
    return reference(
        x["query"],
        x["key"],
        x["value"],
        x["g"],
        x["beta"],
        initial_state=x["initial_state"],
        normalize_qk=x["use_qk_l2norm_in_kernel"],
    )[1]


def selective_scan_part(part):
    x = part.inputs
    if part.kernel == rh.SelectiveScan.kernel_for("prompt").name:
        t = lambda v: v.transpose(1, 2)  # noqa: E731  channel-major -> token-major
        return selective_scan_reference(
            t(x["hidden_states"]),
            t(x["dt"]),
            x["A"],
            t(x["B"]),
            t(x["C"]),
            dt_bias=x["delta_bias"],
            softplus=x["delta_softplus"],
        )[1]
    return selective_scan_reference(
        x["hidden_states"][:, None],
        x["dt"][:, None],
        x["A"],
        x["B"][:, None],
        x["C"][:, None],
        dt_bias=x["dt_bias"],
        softplus=x["dt_softplus"],
        initial_state=x["state"],
    )[1]


def state_space_part(part):
    x = part.inputs
    if part.kernel == rh.Mamba2StateSpace.kernel_for("prompt").name:
        return ssd_reference(
            x["hidden_states"],
            x["dt"],
            x["A"],
            x["B"],
            x["C"],
            dt_bias=x["dt_bias"],
            softplus=x["dt_softplus"],
            dt_limit=x["dt_limit"],
            initial_state=x["initial_states"],
        )[1]
    # the decode kernel gets the per-head parameters expanded over head_dim: channel 0 is the head's
    return ssd_reference(
        x["hidden_states"][:, None],
        x["dt"][:, None, :, 0],
        x["A"][:, 0, 0],
        x["B"][:, None],
        x["C"][:, None],
        dt_bias=None if x["dt_bias"] is None else x["dt_bias"][:, 0],
        softplus=x["dt_softplus"],
        dt_limit=(-math.inf, math.inf),
        initial_state=x["state"],
    )[1]


REFERENCES = {
    rh.GatedDeltaNet: gated_delta_part,
    rh.KimiDeltaAttention: gated_delta_part,
    rh.SelectiveScan: selective_scan_part,
    rh.PerHeadSelectiveScan: selective_scan_part,
    rh.Mamba2StateSpace: state_space_part,
}
