"""Facts about aten ops that several rule families share, each stated once: the op families themselves
(``Family``), which arguments of a matmul-like op are its factors, which ops are matmul-like, and which ops
only move, select or partly overwrite values.

Op sets hold base names (``plan.base``: "add" for ``aten.add_.Tensor``), so an op's in-place and out=
overloads belong to the set of its name; the families build what they treat alike by set algebra.
``OPSETS`` names them all (``shadow.explain`` lists the sets an op is in).

>>> MATMULS["addmm"]
Matmul(a='mat1', b='mat2', bias='self')
>>> "cat" in DATA_MOVEMENT, "relu" in SELECTION, "index_add" in PARTIAL_WRITES, "convolution" in MATMUL_LIKE
(True, True, True, True)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection


class Family(str, enum.Enum):
    """The op families, one vocabulary for every per-op table: replay rules (``shadow.replay``), error budgets
    (``shadow.budgets``) and high-precision references (``shadow.references``) name the family of each rule
    when they register it, and ``shadow.explain`` reports it. The value is the name a budget carries
    (``Budget.family``, saved in reports as ``BudgetInfo.family``): values never change.

    A family's rules live in the module of the same group in each package: ``elementwise`` (elementwise,
    movement), ``reductions``, ``linalg`` (matmul, conv, fft, unbounded), ``normalization``, ``losses``,
    ``attention``, ``recurrent``; ``optimizer`` holds the elementwise rules of the optimizers' fused ops and the
    foreach ops.

    >>> Family.MATMUL == "matmul", f"{Family.NORM}"
    (True, 'norm')
    """

    ELEMENTWISE = "elementwise"  # each result a few roundings of its inputs (arithmetic, transcendentals)
    MOVEMENT = "movement"  # values moved or selected, not computed
    REDUCTION = "reduction"  # long sums: sum, mean, var/std, vector norms, softmax, pooling, scatter-adds
    MATMUL = "matmul"  # inner products: mm, bmm, addmm, matmul, linear, mv, dot
    CONV = "conv"  # convolutions and their backward
    FFT = "fft"
    UNBOUNDED = "unbounded"  # solves, factorizations, eigen and singular values: no a-priori bound
    NORM = "norm"  # layer, group, batch and RMS normalization
    LOSS = "loss"
    ATTENTION = "attention"  # scaled dot product attention
    COMPOSED = "composed"  # a fused kernel bounded stage by stage over its decomposition (the encoder layer)
    GRAPH = "graph"  # a compiled graph's call, bounded over its aten graph (shadow.compiled)
    RECURRENT = "recurrent"  # LSTM and GRU layers and cells
    FOREACH = "foreach"  # _foreach_X: each list element as X
    VIEW = "view"  # views and metadata: nothing to recompute
    RANDOM = "random"  # random draws: the device's values are adopted
    UNINITIALIZED = "uninitialized"  # empty and its kin: the device's bytes are the value
    COLLECTIVE = "collective"  # c10d collectives, replayed on shadow's own process groups
    DEFAULT = "default"  # a budget no rule gives: a guess of a few ulps
    EMPTY = "empty"  # a budget with nothing to bound (no floating output with elements)

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Matmul:
    """The argument names of a matmul-like op: ``out = beta * bias + alpha * (a @ b)`` (no bias: a @ b)."""

    a: str
    b: str
    bias: str | None = None


# by base name: in-place twins (addmm_) share their op's roles
MATMULS: dict[str, Matmul] = {
    "mm": Matmul("self", "mat2"),
    "bmm": Matmul("self", "mat2"),
    "matmul": Matmul("self", "other"),
    "mv": Matmul("self", "vec"),
    "dot": Matmul("self", "tensor"),
    "vdot": Matmul("self", "other"),
    "inner": Matmul("self", "other"),
    "addmm": Matmul("mat1", "mat2", "self"),
    "_addmm_activation": Matmul("mat1", "mat2", "self"),
    "baddbmm": Matmul("batch1", "batch2", "self"),
    "addbmm": Matmul("batch1", "batch2", "self"),
    "addmv": Matmul("mat", "vec", "self"),
    "linear": Matmul("input", "weight", "bias"),  # input @ weight.T + bias
}
# convolutions: input (x) weight, by base name
CONVOLUTIONS: dict[str, Matmul] = {
    "convolution": Matmul("input", "weight", "bias"),
    "_convolution": Matmul("input", "weight", "bias"),
    "convolution_overrideable": Matmul("input", "weight", "bias"),
}

# Matmul-like: a narrow format's bits in them are TF32's (tensor cores), not float16's; their backward and the
# entry points torch dispatches before they decompose included
MATMUL_LIKE = frozenset(MATMULS) | frozenset(CONVOLUTIONS) | frozenset({
    "conv1d", "conv2d", "conv3d", "convolution_backward", "mkldnn_convolution", "_scaled_mm",
})

# Pure data movement: every value of the result is a value of an input (or a fill constant), placed
# elsewhere; no arithmetic. Bit-exact on every device.
DATA_MOVEMENT = frozenset({
    "copy", "_copy_from", "_copy_from_and_resize", "_to_copy", "clone", "lift_fresh", "lift_fresh_copy",
    "detach", "cat", "stack", "index", "index_select", "gather", "take", "take_along_dim", "masked_select",
    "nonzero", "index_copy", "index_fill", "masked_fill", "masked_scatter", "slice_scatter", "select_scatter",
    "diagonal_scatter", "as_strided_scatter", "where", "fill", "zero", "zeros", "zeros_like", "ones",
    "ones_like", "full", "full_like", "new_zeros", "new_ones", "new_full", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "scalar_tensor", "eye", "flip", "roll", "rot90", "repeat", "repeat_interleave",
    "constant_pad_nd", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d",
    "replication_pad2d", "replication_pad3d", "tril", "triu", "_local_scalar_dense", "resize", "resize_as",
    "set", "_foreach_copy", "narrow_copy", "_unsafe_index", "embedding", "select_backward", "slice_backward",
    "diagonal_backward", "diag_embed", "diag", "im2col", "channel_shuffle", "pixel_shuffle", "pixel_unshuffle",
    "native_channel_shuffle", "_unsafe_masked_index", "_unsafe_view", "_reshape_alias", "_to_dense", "to_dense",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "block_diag", "_chunk_cat", "unsafe_split",
    "unsafe_split_with_sizes", "masked_scatter_backward",
    # nested tensors packed from a padded batch or a list, and padded back
    "_nested_tensor_from_mask", "_nested_tensor_from_tensor_list", "_nested_from_padded",
    "_nested_from_padded_and_nested_example", "to_padded_tensor",
})
# Copies of views (``torch.Tag.view_copy`` marks them too)
VIEW_COPIES = frozenset({
    "detach_copy", "alias_copy", "expand_copy", "permute_copy", "view_copy", "unfold_copy", "t_copy",
    "transpose_copy", "squeeze_copy", "unsqueeze_copy", "diagonal_copy", "select_copy", "slice_copy",
    "split_copy", "split_with_sizes_copy", "unbind_copy", "as_strided_copy", "_reshape_copy",
    "_nested_view_from_buffer_copy",
    "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk",  # views their schema does not declare (GRU's gates)
})
# Exact selections: each result element is an input value, chosen by comparison, or an exact function of
# one (sign, magnitude, integer part); the only rounding is of a Python scalar or a cast to the result.
SELECTION = frozenset({
    "relu", "threshold", "threshold_backward", "hardtanh", "hardtanh_backward", "hardshrink", "clamp",
    "clamp_min", "clamp_max", "clip", "maximum", "minimum", "fmax", "fmin", "max", "min", "amax", "amin",
    "aminmax", "sort", "topk", "kthvalue", "median", "nanmedian", "mode", "cummax", "cummin",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "fractional_max_pool2d", "fractional_max_pool3d", "max_unpool2d", "max_unpool3d", "abs", "neg", "sign",
    "floor", "ceil", "trunc", "frac", "positive", "conj_physical", "copysign", "heaviside", "nan_to_num",
    "complex", "_unique", "_unique2", "unique_dim", "unique_consecutive", "hardshrink_backward",
    "softshrink_backward",
})
# Ops that write only part of their destination (and may accumulate into it)
PARTIAL_WRITES = frozenset({
    "index_add", "index_reduce", "scatter", "scatter_add", "scatter_reduce", "index_put", "_index_put_impl",
    "_unsafe_index_put", "put", "fill_diagonal",
})

# every op set by name, for what explains an op
OPSETS: dict[str, Collection[str]] = {
    "MATMULS": MATMULS, "CONVOLUTIONS": CONVOLUTIONS, "MATMUL_LIKE": MATMUL_LIKE, "DATA_MOVEMENT": DATA_MOVEMENT,
    "VIEW_COPIES": VIEW_COPIES, "SELECTION": SELECTION, "PARTIAL_WRITES": PARTIAL_WRITES,
}
