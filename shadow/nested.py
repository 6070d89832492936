"""Nested tensors (``torch.nested``, strided layout): components of shapes of their own in one buffer storage, each
at its own offset with its own strides. nn.TransformerEncoder's fast path for padded batches in eval runs on them
(``_nested_tensor_from_mask``, ``_transformer_encoder_layer_fwd``, ``to_padded_tensor``).

The mirror holds a nested tensor's shadow as it holds a dense one's: the float64 shadow of its buffer storage, and
the tensor's shadow is a float64 nested tensor over that shadow with the same nested sizes, strides and offsets
(``view``), so the float64 CPU kernels of the nested ops replay it. A nested result is judged by its values
(``values``): the elements of its components in order, what its padded form holds besides the padding.

>>> buffer = torch.arange(6.0)
>>> nt = torch.nested.nested_tensor([torch.zeros(2, 2), torch.zeros(1, 2)])
>>> view(buffer, nt).to_padded_tensor(-1.0).tolist()
[[[0.0, 1.0], [2.0, 3.0]], [[4.0, 5.0], [-1.0, -1.0]]]
>>> values(view(buffer, nt)).tolist()
[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
"""

from __future__ import annotations

import torch

from . import _compat


def view(buffer: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A nested tensor over ``buffer`` (1-D: the shadow of t's storage) laid out as nested tensor ``t``; a nested copy
    of those components where torch cannot view them (torch 2.4.1 views only a buffer of the components' size; a
    shadow the replay writes there, the mirror writes back: ``Mirror.commit_write``)."""
    sizes, strides, offsets = t._nested_tensor_size(), t._nested_tensor_strides(), t._nested_tensor_storage_offsets()
    if buffer.numel() == int(sizes.prod(1).sum()) or _compat.nested_views_of_larger_buffers():
        return torch._nested_view_from_buffer(buffer, sizes, strides, offsets)
    return torch.nested.as_nested_tensor(components(buffer, t))


def components(buffer: torch.Tensor, t: torch.Tensor) -> list[torch.Tensor]:
    """The strided views of ``buffer`` (1-D) that nested tensor t's components are of its storage."""
    return [buffer.as_strided(size, stride, offset) for size, stride, offset in zip(
        t._nested_tensor_size().tolist(), t._nested_tensor_strides().tolist(),
        t._nested_tensor_storage_offsets().tolist())]


def write(buffer: torch.Tensor, t: torch.Tensor, value: torch.Tensor) -> None:
    """Write nested tensor ``value``'s components where those of nested tensor t lie in ``buffer`` (1-D: the shadow
    of t's storage)."""
    if t.is_contiguous() and value.is_contiguous():
        _span(buffer, t).copy_(values(value))
        return
    for part, v in zip(components(buffer, t), value.unbind()):
        part.copy_(v)


def values(t: torch.Tensor) -> torch.Tensor:
    """The elements of nested tensor t's components, in order, as one 1-D tensor: a view of its buffer where the
    components lie one after the other, each contiguous, else a copy."""
    t = t.detach()
    if t.is_contiguous():
        return _span(t.values(), t)
    return torch.cat([c.reshape(-1) for c in t.unbind()])


def _span(buffer: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The part of ``buffer`` (1-D: t's storage or its shadow) that contiguous nested tensor t's components fill."""
    offsets = t._nested_tensor_storage_offsets()
    start = int(offsets[0]) if offsets.numel() else 0
    return buffer[start:start + t.numel()]


def alike(a: object, b: object) -> bool:
    """Whether ``a`` and ``b`` are nested tensors of the same components' shapes."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_nested and b.is_nested \
        and torch.equal(a._nested_tensor_size(), b._nested_tensor_size())


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether nested tensors ``a`` and ``b`` lay out their components alike (sizes, strides, offsets)."""
    return alike(a, b) and torch.equal(a._nested_tensor_strides(), b._nested_tensor_strides()) \
        and torch.equal(a._nested_tensor_storage_offsets(), b._nested_tensor_storage_offsets())
