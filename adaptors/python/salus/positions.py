"""The positions of a mask from the batch (``mask.nonzero()``, ``torch.where(mask)``)
while a step records, as a mixture-of-experts layer routes tokens to its experts:

    for expert in mask_of_experts_hit.nonzero():          # every expert, in order
        token, slot = torch.where(routed_to[expert].squeeze(0))
        out = self.experts[expert](x[token]) * weight[token, slot, None]
        y.index_add_(0, token, out)

How many positions there are depends on the mask's values, a shape salus cannot fix.
So :class:`Positions` holds every position of the mask, in the order ``nonzero`` gives
them, with the mask (``keep``) beside: what they index is a
:class:`~salus.selections.Selection` of as many rows, the rows the mask leaves out
counting for nothing. ``index_add_`` and ``index_put_`` (``y[token] = ...``,
``y[token] += ...``) of such rows add or write the kept rows only. Iterating positions
(``for expert in hit.nonzero()``) runs the loop's body once for every position of the
mask: for one the mask leaves out, the body's own selections select nothing, as they
would in eager PyTorch if it ran; the body must let its results reach the rest of the
step through them (``index_add_``, ``index_put_``, a masked sum), as a mixture of
experts does. How many positions there are is a :class:`Count`: compared with 0 (a
branch that skips an expert no token chose) it takes the non-empty branch, and any
other use is refused, naming it.
"""

from __future__ import annotations

import operator

import torch
import torch.utils._pytree as pytree

from .errors import TraceError
from .stand_ins import StandIn, route


def _refuse(what: str):
    raise TraceError(
        f"the step {what} the positions of a mask from the batch (nonzero, torch.where(mask), "
        "argwhere): how many there are depends on the mask's values, and salus follows "
        "them only as indices (x[positions], index_add_, index_put_, an assignment "
        "y[positions] = ...), in elementwise arithmetic, and as the items of a loop "
        "(for e in hit.nonzero()) whose body uses them so. Compute over every position and "
        "mask the result instead (torch.where(mask, ..., 0))")


#: The most positions a mask may have (each is a row of what they index).
_MOST = 1 << 20

_ARITHMETIC = {"add", "sub", "mul", "floor_divide", "remainder", "__add__", "__radd__",
               "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__", "__mod__"}


class RowsStandIn(StandIn):
    """A stand-in with a row per position of a mask, ``keep`` (and ``mask``) beside:
    what it answers as a tensor. Its rows are ``_data()``'s dim 0, whose count is a
    :class:`Count`; ``_refuse`` names what it cannot answer."""

    keep: torch.Tensor
    mask: torch.Tensor

    def _data(self) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _refuse(what: str):
        raise NotImplementedError

    @property
    def dtype(self):
        return self._data().dtype

    @property
    def device(self):
        return self._data().device

    def dim(self) -> int:
        return self._data().dim()

    @property
    def shape(self) -> tuple:
        """The rows' count (a :class:`Count`), then a row's shape."""
        return (Count(self.keep, self.mask), *self._data().shape[1:])

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self):
        return Count(self.keep, self.mask)

    def _same(self, other) -> bool:
        """Whether ``other`` stands for rows of the same mask."""
        return other.mask is self.mask or other.keep is self.keep

    def __len__(self):
        self._refuse("reads the length of")

    def __bool__(self):
        self._refuse("branches on")


class Positions(RowsStandIn):
    """Every position of ``mask``: ``values`` [R, dims] (``nonzero()``'s rows) or [R]
    (one dim's coordinates: a column, as ``torch.where(mask)`` gives one per dim),
    ``keep`` [R], whether the mask holds each (the mask flattened), and
    ``coordinates``, the same positions as Python tuples (known when the step records:
    they follow the mask's shape, not its values; None once arithmetic changed them)."""

    def __init__(self, values: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor,
                 coordinates: list[tuple[int, ...]] | None):
        self.values, self.keep, self.mask = values, keep, mask
        self.coordinates = coordinates

    @classmethod
    def of(cls, mask: torch.Tensor) -> "Positions":
        """``mask.nonzero()``'s positions: [R, mask.dim()] (a mask of numbers holds
        where they are not 0)."""
        if mask.numel() > _MOST:
            _refuse(f"takes more than {_MOST} candidates for")
        coordinates = [_unravel(r, mask.shape) for r in range(mask.numel())]
        values = torch.tensor(coordinates, dtype=torch.long, device=mask.device).reshape(
            mask.numel(), mask.dim())
        keep = mask if mask.dtype == torch.bool else torch.ne(mask, 0)
        return cls(values, keep.reshape(-1), mask, coordinates)

    def columns(self) -> tuple["Positions", ...]:
        """``nonzero(as_tuple=True)`` / ``torch.where(mask)``: one column per dim."""
        return tuple(Positions(self.values[:, d], self.keep, self.mask,
                               [(c[d],) for c in self.coordinates])
                     for d in range(self.values.shape[1]))

    def __iter__(self):
        """Every position, kept or not (see the module's note)."""
        if self.coordinates is None:
            _refuse("iterates computed values of")
        for coordinates in self.coordinates:
            yield Candidate(coordinates, self.values.dim() == 2)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        from .selections import Selection
        leaves = pytree.tree_leaves((args, kwargs))
        mine = [a for a in leaves if isinstance(a, cls)]
        first = mine[0]
        if any(not first._same(p) for p in mine[1:]):
            _refuse(f"combines two masks' positions in {name} with")
        if name in ("index_add_", "index_add"):
            return first._index_add(func, args, kwargs)
        if name in _ARITHMETIC and not any(isinstance(a, Selection) for a in leaves):
            plain_args, plain_kwargs = pytree.tree_map(
                lambda a: a.values if isinstance(a, cls) else a, (args, kwargs))
            return Positions(func(*plain_args, **plain_kwargs), first.keep, first.mask, None)
        single = first.values.dim() == 2 and first.values.shape[1] == 1 and args[0] is first
        if name in ("view", "reshape", "flatten") and single:
            return first.columns()[0]
        if name == "squeeze" and single and (args[1:] or kwargs):
            return first.columns()[0]  # squeeze() would also drop a single position's dim
        if name == "__getitem__" and args[0] is first and isinstance(args[1], slice) \
                and args[1] == slice(None):
            return first
        if name == "__getitem__" and first.values.dim() == 2 and args[0] is first:
            index = args[1]
            if (isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None)
                    and isinstance(index[1], int)):
                return first.columns()[index[1]]
        if name == "expand" and single:
            sizes = list(args[1:]) if not (len(args) == 2 and isinstance(args[1], (
                tuple, list))) else list(args[1])
            if len(sizes) == 2 and isinstance(sizes[1], int) and (
                    isinstance(sizes[0], Count) or sizes[0] == -1):
                out = Positions(first.values, first.keep, first.mask, None)
                out.width = sizes[1]
                return out
        if name == "gather" and args[0] is not first and len(mine) == 1:
            return first._gather(args, kwargs)
        if name == "unbind" and first.values.dim() == 2 and args[0] is first and \
                (list(args[1:]) or [kwargs.get("dim", 0)])[0] in (1, -1):
            return first.columns()
        _refuse(f"applies {name} to")

    #: The columns a single-column ``nonzero()`` was expanded to (``expand(n, width)``).
    width: int | None = None

    def _gather(self, args, kwargs):
        """``torch.gather(input, 0, positions)``: a row of ``input`` per position, for
        positions of one column (a vector ``input``) or expanded over ``input``'s
        columns (DeBERTa's labelled rows)."""
        from .selections import Selection
        given = dict(zip(("input", "dim", "index"), args), **kwargs)
        tensor, dim = given["input"], given["dim"]
        column = self.values if self.values.dim() == 1 else self.values[:, 0]
        if dim != 0 or isinstance(tensor, (Positions, Selection)) or not (
                (self.values.dim() == 1 and tensor.dim() == 1)
                or (self.width is not None and tensor.dim() == 2
                    and tensor.shape[1] == self.width)):
            _refuse("gathers other than whole rows along dim 0 by")
        return Selection.kept(tensor.index_select(0, column), self.keep, self.mask)

    def _index_add(self, func, args, kwargs):
        from .selections import Selection
        given = dict(zip(("input", "dim", "index", "source"), args), **kwargs)
        target, dim, source = given.pop("input"), given.pop("dim"), given.pop("source")
        if isinstance(target, (Positions, Selection)) or given.pop("index") is not self:
            _refuse(f"gives {getattr(func, '__name__', func)} as its input")
        if not (isinstance(source, Selection) and self._same(source)):
            _refuse("index_adds a source that is not a selection by the same positions, with")
        if self.values.dim() != 1:
            _refuse("index_adds at the rows of")
        return func(target, dim, self.values,
                    torch.movedim(source.masked(), 0, dim % target.dim()), **given)

    def index_rows(self, tensor: torch.Tensor, index: tuple):
        """``tensor[index]`` with positions in ``index`` (next to one another; ``None``,
        ``:`` and ``...`` elsewhere): a selection with a row per position."""
        from .selections import Selection
        # the advanced indices: the positions, and any tensor beside them
        at = [i for i, item in enumerate(index) if isinstance(item, (Positions, torch.Tensor))]
        if at != list(range(at[0], at[-1] + 1)):
            _refuse("indexes a tensor with positions and other indices apart from one "
                    "another, among")
        plain = tuple(i.values if isinstance(i, Positions) else i for i in index)
        for item in plain:
            if not (isinstance(item, torch.Tensor) or item is None or item is Ellipsis
                    or item == slice(None)):
                _refuse("indexes a tensor with integers or ranges, as well as")
        result = torch.Tensor.__getitem__(tensor, plain)
        # where the row dim lands: the dims of the index's items before the positions
        consumed = sum(1 for i in plain if i is not None and i is not Ellipsis)
        before = 0
        for item in plain[:at[0]]:
            if item is Ellipsis:
                before += tensor.dim() - consumed
            else:
                before += 1
        if any(n != 1 for n in result.shape[:before]):
            _refuse("indexes a tensor with positions after a dim of more than one element, "
                    "among")
        rows = result.reshape(result.shape[before:])
        return Selection.kept(rows, self.keep, self.mask)

    def put(self, tensor: torch.Tensor, value) -> None:
        """``tensor[positions] = value`` in place: the kept rows written, the others
        sent to a row past the end that is then dropped."""
        from .selections import Selection
        if isinstance(value, Selection):
            if not self._same(value):
                _refuse("assigns another mask's selection at")
            rows = value.rows
        elif isinstance(value, (int, float, bool)) or (
                isinstance(value, torch.Tensor) and value.dim() < tensor.dim()):
            rows = torch.as_tensor(value, dtype=tensor.dtype).expand(
                self.values.shape[0], *tensor.shape[1:])
        else:
            _refuse("assigns a tensor of the unselected shape at")
        if self.values.dim() != 1:
            _refuse("assigns at the rows of")
        n = tensor.shape[0]
        padded = torch.cat([tensor, torch.zeros_like(tensor[:1])])
        index = torch.where(self.keep, self.values, torch.full_like(self.values, n))
        padded = torch.index_put(padded, (index,), rows.to(tensor.dtype))
        tensor.copy_(padded[:n])

    def _data(self) -> torch.Tensor:
        return self.values

    _refuse = staticmethod(_refuse)


def _unravel(flat: int, shape) -> tuple[int, ...]:
    """The coordinates of position ``flat`` of a row-major ``shape``."""
    out = []
    for n in reversed(shape):
        flat, rest = divmod(flat, n)
        out.append(rest)
    return tuple(reversed(out))


route(Positions, ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                  "__floordiv__", "__mod__", "__getitem__"))
Positions.__hash__ = object.__hash__


#: The masks (their flattened form, by id) whose positions a branch took as not empty.
_ASSUMED: dict[int, torch.Tensor] = {}


_CHECKED: set[int] = set()


def check_nonempty(keep: torch.Tensor) -> None:
    """Where a branch took the positions of ``keep`` as not empty and a value is
    reduced from what they select, the graph checks that one is kept (see
    :class:`Count`)."""
    if id(keep) in _ASSUMED and id(keep) not in _CHECKED:
        _CHECKED.add(id(keep))
        torch._assert_async(torch.any(keep), _EMPTY)


_EMPTY = ("salus: the step took the branch for a mask from the batch with positions (a "
          "test like 'if x.numel() > 0'), but this batch's mask has none, so eager PyTorch "
          "would have taken the other branch: the iteration is refused rather than run on "
          "the wrong branch")


def forget_assumptions() -> None:
    _ASSUMED.clear()
    _CHECKED.clear()


class Count:
    """How many positions (or selected rows) there are, while the step records: unknown
    until it runs. Compared with 0 (``if token.numel() > 0``, ``if x.shape[0] == 0:
    continue``: a mixture of experts skipping an expert no token chose), it answers
    "not empty", and the branch for positions is recorded. For an empty mask that branch
    runs on selections that select nothing: its ``index_add_`` and assignments change
    nothing, as eager PyTorch's skipped branch; a value it reduces from them (a loss,
    a sum) is checked in the graph to come from at least one position, failing the
    iteration otherwise, where eager PyTorch would have taken the other branch. Work
    in the branch on other tensors runs for an empty mask too, unseen (see
    ``docs/pytorch.md``). Any other use of the count is refused."""

    def __init__(self, keep: torch.Tensor, mask: torch.Tensor):
        self.keep, self.mask = keep, mask

    def _answer(self, op: str, other) -> bool:
        """The answer for a non-empty mask, where it is the same for every count above
        0 (``> 0``, ``>= 1``, ``!= 0``, ``== 0``, ``< 1``, ``<= 0``)."""
        answers = {(">", 0): True, (">=", 1): True, ("!=", 0): True, ("==", 0): False,
                   ("<", 1): False, ("<=", 0): False}
        key = (op, other if isinstance(other, int) and not isinstance(other, bool) else None)
        if key not in answers:
            _refuse(f"compares ({op} {other!r}) the count of")
        _ASSUMED[id(self.keep)] = self.keep
        return answers[key]

    def __gt__(self, other):
        return self._answer(">", other)

    def __ge__(self, other):
        return self._answer(">=", other)

    def __lt__(self, other):
        return self._answer("<", other)

    def __le__(self, other):
        return self._answer("<=", other)

    def __eq__(self, other):
        return self._answer("==", other)

    def __ne__(self, other):
        return self._answer("!=", other)

    def __bool__(self):
        return self._answer("!=", 0)

    __hash__ = object.__hash__

    def _used(self, *_):
        _refuse("uses the count of")

    __index__ = __int__ = __float__ = __neg__ = _used
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _used
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = _used


class Candidate:
    """One position while a loop iterates positions (``for e in hit.nonzero()``): its
    coordinates, known when the step records. It indexes as the one-position tensor
    eager PyTorch iterates (``experts[e]``, ``x[e]``), and ``int(e)``/``e.item()``
    give it."""

    def __init__(self, coordinates: tuple[int, ...], row: bool):
        self.coordinates, self.row = coordinates, row

    def tensor(self) -> torch.Tensor:
        return torch.tensor(list(self.coordinates) if self.row else self.coordinates[0])

    def __getitem__(self, index) -> "Candidate":
        if not self.row or not isinstance(index, int):
            _refuse("indexes other than by one integer a position of")
        return Candidate((self.coordinates[index],), False)

    def _compare(self, other, op):
        if isinstance(other, Candidate):
            other = other.__index__()
        if not isinstance(other, (int, float)):
            _refuse("compares with a tensor a position of")
        return op(self.__index__(), other)

    def __eq__(self, other):
        return self._compare(other, operator.eq)

    def __ne__(self, other):
        return self._compare(other, operator.ne)

    def __lt__(self, other):
        return self._compare(other, operator.lt)

    def __le__(self, other):
        return self._compare(other, operator.le)

    def __gt__(self, other):
        return self._compare(other, operator.gt)

    def __ge__(self, other):
        return self._compare(other, operator.ge)

    __hash__ = object.__hash__

    def __index__(self) -> int:
        if len(self.coordinates) != 1:
            _refuse("takes one integer from a position of several dims among")
        return self.coordinates[0]

    __int__ = __index__

    def item(self) -> int:
        return self.__index__()

    def tolist(self):
        return list(self.coordinates) if self.row else self.coordinates[0]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        plain_args, plain_kwargs = pytree.tree_map(
            lambda a: a.tensor() if isinstance(a, cls) else a, (args, kwargs or {}))
        return func(*plain_args, **plain_kwargs)
