"""The maths several kinds share; none of these modules is a kind (no `RecurrentMixer` is declared here, and the
tests find a kind's contract adapter by its module in `kinds/`, never here): `conv` (the short causal convolution's
window kernels, `CONV_KERNELS`, declared by every kind with a convolution, and its attribution window term),
`delta_rule` (the gated delta rule's loop, chunk-wise states and adjoint, with the kernels' transformers signatures
written once: gated DeltaNet, Kimi delta attention), `ssm` (the state-space discretisation and the kernels'
transformers signatures written once: Mamba-1, Mamba-2) and `recording` (the limit of a forward over a cache that
records its past, said once for the kinds whose transformers code splits it). A kind imports their public names; they
import the engine and nothing from a kind.
"""
