"""Selections by a boolean mask from the batch (``out[mask]``, ``masked_select``), while
a step records: what they select depends on the mask's values, a shape salus cannot fix,
so the selection keeps every row with the mask beside it (:class:`Selection`), and what
the step then computes on it is computed on all rows, the mask deciding what counts:

- elementwise ops (with numbers, or tensors that broadcast over a row), ``softmax`` and
  ``log_softmax`` within a row, products with a matrix on the right, trailing slices,
  casts: a selection again;
- ``sum`` and ``mean`` of everything (or over the rows): the masked sum, over the
  selected elements' count for a mean;
- the losses of ``torch.nn.functional`` (cross-entropy and negative log-likelihood with
  the unselected rows' targets ignored; elementwise losses by their masked mean or sum).

Rows the mask leaves out take the values of a selected row (detached) first, so they
compute nothing eager PyTorch would not, and add nothing to a result or a gradient.
Anything else done with a selection (its shape, which depends on the mask, an op not
above) is refused, naming the op. The results are eager PyTorch's on the selected rows.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.utils._pytree as pytree

from .errors import TraceError
from .positions import RowsStandIn, check_nonempty
from .stand_ins import route

_ELEMENTWISE = {
    "add", "sub", "mul", "div", "true_divide", "pow", "neg", "abs", "exp", "log", "log1p",
    "expm1", "sqrt", "rsqrt", "sigmoid", "tanh", "relu", "clamp", "clamp_min", "clamp_max",
    "square", "sign", "eq", "ne", "lt", "le", "gt", "ge", "float", "double", "half",
    "bfloat16", "long", "int", "bool", "to", "type_as", "detach", "clone", "contiguous",
    "logical_not", "logical_and", "logical_or", "where", "minimum", "maximum", "reciprocal",
    "sin", "cos", "erf", "log2", "log10", "softplus", "logsigmoid", "gelu", "silu", "elu",
    "leaky_relu", "hardtanh", "nan_to_num", "floor", "ceil", "round", "trunc", "frac",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__pow__", "__rpow__", "__neg__", "__abs__", "__eq__", "__ne__",
    "__lt__", "__le__", "__gt__", "__ge__", "__and__", "__or__", "__invert__",
}
_WITHIN_ROW = {"softmax", "log_softmax"}
_INDEX_LOSSES = {"cross_entropy", "nll_loss"}
_ELEMENTWISE_LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                       "binary_cross_entropy", "binary_cross_entropy_with_logits",
                       "soft_margin_loss", "poisson_nll_loss", "kl_div"}


def _refuse(what: str):
    raise TraceError(
        f"the step {what} a selection by a boolean mask from the batch (x[mask]): its shape "
        "depends on the mask's values, and salus follows such a selection only through "
        "elementwise ops, softmax within a row, products with a matrix, sum and mean, the "
        "losses of torch.nn.functional, reshapes that keep each row's elements, and "
        "index_add_ or assignments by the mask or its positions. Compute over every "
        "element and mask the result instead: the mean loss over the selected rows is "
        "F.cross_entropy(out, torch.where(mask, target, -100)) (its ignore_index), or, "
        "with reduction='none', "
        "(loss * mask).sum() / mask.sum()")


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


class Selection(RowsStandIn):
    """``tensor[mask]`` while a step records: ``rows`` [R, ...] (the mask's dims flattened
    into one), ``keep`` [R] which rows the mask selects, and ``mask``, the mask given."""

    def __init__(self, rows: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor):
        self.rows, self.keep, self.mask = rows, keep, mask

    @classmethod
    def of(cls, tensor: torch.Tensor, mask: torch.Tensor) -> "Selection":
        keep = mask.reshape(-1)
        return cls.kept(tensor.reshape(keep.shape[0], *tensor.shape[mask.dim():]), keep,
                        mask)

    @classmethod
    def kept(cls, rows: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor
             ) -> "Selection":
        """The selection of ``rows`` [R, ...] where ``keep`` [R] holds; the other rows
        take the first kept row's values (detached)."""
        first = keep.to(torch.int32).argmax()
        stand_in = rows.index_select(0, first.reshape(1)).detach()
        return cls(torch.where(cls._spread(keep, rows), rows, stand_in), keep, mask)

    @staticmethod
    def _spread(keep: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return keep.reshape(keep.shape[0], *([1] * (like.dim() - 1)))

    def _again(self, rows: torch.Tensor) -> "Selection":
        return Selection(rows, self.keep, self.mask)

    def masked(self, values: torch.Tensor | None = None) -> torch.Tensor:
        """``values`` (by default the rows) with the rows the mask leaves out at 0."""
        values = self.rows if values is None else values
        return torch.where(self._spread(self.keep, values), values, torch.zeros_like(values))

    def masked_sum(self, values: torch.Tensor | None = None) -> torch.Tensor:
        check_nonempty(self.keep)
        return self.masked(values).sum()

    def masked_mean(self, values: torch.Tensor | None = None) -> torch.Tensor:
        values = self.rows if values is None else values
        per_row = math.prod(values.shape[1:])
        count = self.keep.sum().to(values.dtype if values.dtype.is_floating_point
                                   else torch.float32)
        return self.masked_sum(values) / (count * per_row)

    # -- the torch function protocol -------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        selections = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls)]
        first = selections[0]
        if any(not first._same(s) for s in selections[1:]):
            _refuse(f"combines with another mask's selection ({name})")
        if name in _INDEX_LOSSES:
            return first._index_loss(func, args, kwargs)
        if name in _ELEMENTWISE_LOSSES:
            return first._elementwise_loss(func, args, kwargs)
        if name in ("sum", "mean"):
            return first._reduce(name, args, kwargs)
        plain_args, plain_kwargs = pytree.tree_map(
            lambda a: a.rows if isinstance(a, cls) else a, (args, kwargs))
        if name in _ELEMENTWISE or (name in _WITHIN_ROW and first._within_row(args, kwargs)):
            first._check_broadcast(args, kwargs)
            return first._again(func(*plain_args, **plain_kwargs))
        if name in ("matmul", "linear", "__matmul__", "mm") and isinstance(args[0], cls) \
                and not any(isinstance(a, cls) for a in args[1:]):
            return first._again(func(*plain_args, **plain_kwargs))
        if name in ("__getitem__", "getitem") and first._trailing_index(args[1],
                                                                         first.rows.dim()):
            return first._again(func(*plain_args, **plain_kwargs))
        if name in ("reshape", "view") and args[0] is first:
            return first._reshaped(args[1:], kwargs)
        if name in ("unsqueeze", "squeeze") and args[0] is first and (args[1:] or kwargs):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            dims = first.rows.dim() + (name == "unsqueeze")
            if isinstance(dim, int) and dim % dims != 0:
                return first._again(func(*plain_args, **plain_kwargs))
        _refuse(f"applies {name} to")

    def _reshaped(self, args, kwargs) -> "Selection":
        """``reshape(-1, *trailing)``: the rows keep their count (dims of one element
        before them merge into it), each row the same elements."""
        shape = kwargs.get("shape", args[0] if len(args) == 1 else args)
        shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
        if not shape or shape[0] != -1 or -1 in shape[1:] or \
                math.prod(shape[1:]) != math.prod(self.rows.shape[1:]):
            _refuse("reshapes other than as reshape(-1, ...), each row's elements kept,")
        return self._again(self.rows.reshape(self.rows.shape[0], *shape[1:]))

    def _within_row(self, args, kwargs) -> bool:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        return isinstance(dim, int) and dim % self.rows.dim() != 0

    @staticmethod
    def _trailing_index(index, dims: int) -> bool:
        """An index of the dims after the rows': ``[:, ...]``, or ``[..., i]`` reaching
        fewer dims than there are."""
        if not isinstance(index, tuple) or len(index) < 2:
            return False
        rest = index[1:]
        if not all(isinstance(i, (int, slice)) or i is None or i is Ellipsis for i in rest):
            return False
        if index[0] == slice(None):
            return True
        return index[0] is Ellipsis and sum(i is not None for i in rest) < dims

    def _check_broadcast(self, args, kwargs):
        """A plain tensor must broadcast over a row, not along the rows."""
        for given in pytree.tree_leaves((args, kwargs)):
            if isinstance(given, torch.Tensor) and (
                    given.dim() > self.rows.dim()
                    or (given.dim() == self.rows.dim() and given.shape[0] != 1)):
                _refuse("combines a tensor of the unselected shape with")

    def _reduce(self, name, args, kwargs):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if isinstance(dim, torch.dtype):  # sum(dtype) given positionally
            dim, kwargs = None, {"dtype": dim}
        rows = self.rows if kwargs.get("dtype") is None else self.rows.to(kwargs["dtype"])
        if not (rows.dtype.is_floating_point or name == "sum"):
            _refuse(f"takes the {name} of integers of")
        if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
            return self.masked_sum(rows) if name == "sum" else self.masked_mean(rows)
        dims = [d % rows.dim() for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
        if 0 in dims:
            _refuse(f"takes a {name} along the selected rows (and others) of")
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        return self._again(getattr(torch, name)(rows, dims, keepdim=keepdim))

    def _index_loss(self, func, args, kwargs):
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
                 "reduction", "label_smoothing")
        given = dict(zip(names, args), **kwargs)
        logits, target = given["input"], given["target"]
        if not (isinstance(logits, Selection) and isinstance(target, Selection)):
            _refuse(f"gives {_name(func)} a selected input and an unselected target, or")
        reduction = given.get("reduction", "mean")
        if target.rows.dtype.is_floating_point:  # class probabilities: no ignore_index
            given.update(input=logits.rows, target=target.rows, reduction="none")
            losses = func(**given)
            if reduction == "none":
                return self._again(losses)
            return self.masked_sum(losses) if reduction == "sum" else self.masked_mean(losses)
        ignore = given.get("ignore_index", -100)
        kept = torch.where(self._spread(self.keep, target.rows), target.rows,
                           torch.full_like(target.rows, ignore))
        given.update(input=logits.rows, target=kept, ignore_index=ignore)
        if reduction != "none":
            check_nonempty(self.keep)
        result = func(**given)
        return self._again(result) if reduction == "none" else result

    def _elementwise_loss(self, func, args, kwargs):
        reduction = kwargs.pop("reduction", "mean")
        plain_args, plain_kwargs = pytree.tree_map(
            lambda a: a.rows if isinstance(a, Selection) else a, (args, kwargs))
        self._check_broadcast(args, kwargs)
        losses = func(*plain_args, **plain_kwargs, reduction="none")
        if reduction == "none":
            return self._again(losses)
        if reduction == "batchmean":  # kl_div: over the selected rows
            count = self.keep.sum().to(losses.dtype)
            return self.masked_sum(losses) / count
        return self.masked_sum(losses) if reduction == "sum" else self.masked_mean(losses)

    def _data(self) -> torch.Tensor:
        return self.rows

    _refuse = staticmethod(_refuse)


route(Selection, ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                  "__truediv__", "__rtruediv__", "__pow__", "__rpow__", "__neg__",
                  "__abs__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
                  "__and__", "__or__", "__invert__", "__matmul__", "__getitem__"))
Selection.__hash__ = object.__hash__


def _is_mask_of(tensor: torch.Tensor, index) -> torch.Tensor | None:
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    if (isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.dim() >= 1
            and tuple(index.shape) == tuple(tensor.shape[:index.dim()])):
        return index
    return None


@contextlib.contextmanager
def selections_in_the_graph() -> Iterator[None]:
    """While a step records: ``tensor[mask]`` of a boolean mask over leading dims, and
    ``masked_select`` (the method and the function) of a mask of the tensor's shape, give
    a :class:`Selection`; ``nonzero``, ``argwhere`` and ``torch.where(mask)`` give
    :class:`~salus.positions.Positions`, which index (``tensor[positions]``) a
    :class:`Selection` and take one in assignments (``tensor[mask] = selection``,
    ``tensor[positions] = ...``). All put back after."""
    from .positions import Candidate, Positions, forget_assumptions

    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__
    masked_select, where = torch.Tensor.masked_select, torch.where

    def select(self, index):
        mask = _is_mask_of(self, index)
        if mask is not None:
            return Selection.of(self, mask)
        items = index if isinstance(index, tuple) else (index,)
        if any(isinstance(i, Candidate) for i in items):
            items = tuple(i.tensor() if isinstance(i, Candidate) else i for i in items)
            return select(self, items if isinstance(index, tuple) else items[0])
        if any(isinstance(i, Positions) for i in items):
            return next(i for i in items if isinstance(i, Positions)).index_rows(self, items)
        return getitem(self, index)

    def assign(self, index, value):
        mask = _is_mask_of(self, index)
        items = index if isinstance(index, tuple) else (index,)
        if mask is not None and isinstance(value, Selection):
            if value.mask is not mask:
                _refuse("assigns another mask's selection to")
            rows = self.reshape(value.keep.shape[0], *self.shape[mask.dim():])
            kept = torch.where(Selection._spread(value.keep, rows), value.rows.to(self.dtype),
                               rows)
            self.copy_(kept.reshape(self.shape))
            return
        if len(items) == 1 and isinstance(items[0], Positions):
            items[0].put(self, value)
            return
        if isinstance(value, Selection) or any(isinstance(i, Positions) for i in items):
            _refuse("assigns by an index other than the mask or its positions")
        setitem(self, index, value)

    def select_masked(self, mask):
        if isinstance(mask, torch.Tensor) and tuple(mask.shape) == tuple(self.shape):
            return Selection.of(self.reshape(-1), mask.reshape(-1))
        return masked_select(self, mask)

    def positions(self, *, as_tuple=False):
        found = Positions.of(self)
        return found.columns() if as_tuple else found

    def where_of(condition, *args, **kwargs):
        if not args and not kwargs:
            return Positions.of(condition).columns()
        return where(condition, *args, **kwargs)

    replaced = {"__getitem__": select, "__setitem__": assign, "masked_select": select_masked,
                "nonzero": positions, "argwhere": lambda self: Positions.of(self)}
    own = {name: torch.Tensor.__dict__[name] for name in replaced
           if name in torch.Tensor.__dict__}
    functions = {name: getattr(torch, name) for name in ("masked_select", "nonzero",
                                                         "argwhere", "where")}
    for name, rule in replaced.items():
        setattr(torch.Tensor, name, rule)
    torch.masked_select, torch.nonzero, torch.where = select_masked, positions, where_of
    torch.argwhere = replaced["argwhere"]
    try:
        yield
    finally:
        forget_assumptions()
        for name, function in functions.items():
            setattr(torch, name, function)
        for name in replaced:
            if name in own:
                setattr(torch.Tensor, name, own[name])
            else:
                delattr(torch.Tensor, name)
