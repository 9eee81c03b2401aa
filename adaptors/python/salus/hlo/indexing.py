"""HLO gather and scatter as the IR's advanced indexing (``index.Tensor``, ``index_put``).

XLA's gather and scatter are general (any dimensions indexed, windows of any size). The
forms frameworks emit for embedding lookups, ``x[idx]``, one-hot-free losses and their
gradients index some dimensions at single points and take the others whole from 0; those
are exactly advanced indexing:

- **gather**: the dimensions in ``start_index_map`` are indexed with slice size 1, the
  others are sliced from 0 to their ``slice_sizes``. Start indices are clamped into range,
  as XLA clamps them.
- **scatter** (``to_apply`` add or replace): the dimensions in
  ``scatter_dims_to_operand_dims`` are indexed, and each update window covers the others
  whole. Indices must be in range. XLA skips an update whose window falls outside the
  operand, and the IR has no way to skip one.

Anything else (windows of several elements along an indexed dimension, batching
dimensions) is refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import LoweringError
from .parse import int_list


def _permuted(x: torch.Tensor, order: list[int]) -> torch.Tensor:
    return x if order == list(range(x.dim())) else x.permute(order)


def _index_columns(indices: torch.Tensor, index_vector_dim: int, bounds: list[int],
                   clamp: bool) -> list[torch.Tensor]:
    """One integer tensor per indexed dimension, shaped as the batch of indices."""
    if index_vector_dim == indices.dim():
        indices = indices.unsqueeze(-1)
    elif index_vector_dim != indices.dim() - 1:
        order = [d for d in range(indices.dim()) if d != index_vector_dim] + [index_vector_dim]
        indices = indices.permute(order)
    if indices.dtype not in (torch.int64, torch.int32):
        indices = indices.to(torch.int64)
    columns = []
    for k, bound in enumerate(bounds):
        column = indices.select(-1, k)
        columns.append(torch.clamp(column, 0, bound - 1) if clamp else column)
    return columns


def _batching(i, operand_name: str, indices_name: str, indices: torch.Tensor,
              vector_dim: int) -> tuple[list[int], list[torch.Tensor]]:
    """Batching dimensions (``take_along_axis``): the operand's dimensions, and for each an
    index column that picks, at every batch position, that position's own element along
    it (an iota over the matching dimension of the indices)."""
    operand_dims = int_list(i.attributes.get(operand_name, "{}"))
    indices_dims = int_list(i.attributes.get(indices_name, "{}"))
    batch_shape = [n for d, n in enumerate(indices.shape) if d != vector_dim]
    columns = []
    for d in indices_dims:
        position = d - (1 if vector_dim < d else 0)
        view = [1] * len(batch_shape)
        view[position] = batch_shape[position]
        columns.append(torch.arange(batch_shape[position]).reshape(view).expand(batch_shape))
    return operand_dims, columns


def gather(interpreter, i, operands, constant) -> torch.Tensor:
    from .ops import dense
    operand, indices = operands if constant else [dense(o) for o in operands]
    a = i.attributes
    offset_dims = int_list(a.get("offset_dims", "{}"))
    collapsed = int_list(a.get("collapsed_slice_dims", "{}"))
    start_map = int_list(a["start_index_map"])
    sizes = int_list(a["slice_sizes"])
    vector_dim = int(a["index_vector_dim"])
    batched, batch_columns = _batching(i, "operand_batching_dims",
                                       "start_indices_batching_dims", indices, vector_dim)
    if any(sizes[d] != 1 for d in start_map + batched):
        raise LoweringError("a gather of windows wider than one element along an indexed "
                            "dimension is not supported")
    indexed = start_map + batched
    collapsed = collapsed + batched
    rest = [d for d in range(operand.dim()) if d not in indexed]
    x = _permuted(operand, indexed + rest)
    for k, d in enumerate(rest):
        if sizes[d] != operand.shape[d]:
            x = x.narrow(len(indexed) + k, 0, sizes[d])
    for k in reversed(range(len(rest))):
        if rest[k] in collapsed:
            x = x.squeeze(len(indexed) + k)
    rest = [d for d in rest if d not in collapsed]
    columns = _index_columns(indices, vector_dim, [operand.shape[d] for d in start_map],
                             clamp=True)
    out = torch.ops.aten.index.Tensor(x, columns + batch_columns)  # batch..., rest...
    batch_rank = out.dim() - len(rest)
    # The slice's dimensions in operand order: rest ones as they are, indexed ones that
    # are not collapsed as size 1.
    for d in range(operand.dim()):
        if d in start_map and d not in collapsed:
            position = batch_rank + sum(1 for e in range(d) if e not in collapsed)
            out = out.unsqueeze(position)
    rank = out.dim()
    batch_positions = [p for p in range(rank) if p not in offset_dims]
    order = [0] * rank
    for k, p in enumerate(batch_positions):
        order[p] = k
    for k, p in enumerate(offset_dims):
        order[p] = batch_rank + k
    return _permuted(out, order)


def scatter(interpreter, i, operands, constant) -> torch.Tensor:
    from .ops import dense
    if len(operands) != 3:
        raise LoweringError("a scatter into several arrays at once is not supported")
    operand, indices, updates = operands if constant else [dense(o) for o in operands]
    a = i.attributes
    window = int_list(a.get("update_window_dims", "{}"))
    inserted = int_list(a.get("inserted_window_dims", "{}"))
    to_operand = int_list(a["scatter_dims_to_operand_dims"])
    vector_dim = int(a["index_vector_dim"])
    batched, batch_columns = _batching(i, "input_batching_dims",
                                       "scatter_indices_batching_dims", indices, vector_dim)
    kind = interpreter.reducer(i) if _reduces(interpreter, i) else "replace"
    if kind not in ("add", "replace"):
        raise LoweringError(f"a scatter combining by {kind} is not supported")
    if sorted(inserted) != sorted(to_operand):
        raise LoweringError("a scatter whose windows span an indexed dimension is not "
                            "supported")
    columns = _index_columns(indices, vector_dim, [operand.shape[d] for d in to_operand],
                             clamp=False) + batch_columns
    to_operand = to_operand + batched
    rest = [d for d in range(operand.dim()) if d not in to_operand]
    window_sizes = [updates.shape[w] for w in window]
    if window_sizes != [operand.shape[d] for d in rest]:
        raise LoweringError("a scatter whose windows do not cover the other dimensions "
                            "whole is not supported")
    x = _permuted(operand, to_operand + rest)
    scatter_dims = [d for d in range(updates.dim()) if d not in window]
    values = _permuted(updates, scatter_dims + window)
    out = torch.ops.aten.index_put(x, columns, values, kind == "add")
    order = to_operand + rest
    return _permuted(out, [order.index(d) for d in range(operand.dim())])


def _reduces(interpreter, i) -> bool:
    """False when the scatter's computation just returns the update (a replacement)."""
    computation = interpreter.module.computations[i.attributes["to_apply"].lstrip("%")]
    root = computation.by_name()[computation.root]
    return root.opcode != "parameter"


RULES: dict[str, Any] = {"gather": gather, "scatter": scatter}
