"""Sparse matrices in a step, while it records: the IR has dense tensors only, so a
sparse matrix the step captures (a graph's adjacency matrix in a graph convolutional
network: a global, a plain attribute or a buffer of the model, built before the step
records) is kept as its coordinates and values, and its products with dense tensors are
gathers and index additions over its non-zero entries (``O(nnz * width)``, the work of
PyTorch's sparse kernels, never the dense matrix's ``n * m``).

``torch.sparse.mm``, ``torch.spmm``, ``torch.mm``, ``torch.matmul``, ``@`` and the
methods ``mm``/``matmul`` with the sparse matrix on either side of a dense matrix (or
before a vector), and ``torch.sparse.addmm``/``torch.addmm`` with it as the first
factor are followed; the gradients are autograd's of the gathers and index additions,
for the dense operand. What sparse constants give alone (``adj.t()``, ``coalesce()``,
``to_dense()``, ``torch.sparse.sum``, a normalisation ``D^-1/2 A D^-1/2`` of sparse
tensors) is computed as PyTorch computes it, a constant. A sparse tensor with a dense
one in any other call, a sparse tensor built inside the step (from tensors the step
computes) or one whose values need a gradient is refused, naming it. A sparse matrix
changed in place between steps is refused at the next step, as any tensor the step
captures.

An embedding with ``sparse=True`` (``nn.Embedding``, ``nn.EmbeddingBag``, their
functions) records with a dense gradient: under SGD and Adagrad, the optimizers of
PyTorch's that take sparse gradients besides SparseAdam, every update is the same (a
row the batch did not look up has a zero gradient, which moves neither the row nor its
state); other optimizers are refused, as PyTorch's refuse sparse gradients.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from .errors import TraceError, UnsupportedOptimizerError

_FOLLOWED = ("its products with dense tensors (torch.sparse.mm, torch.spmm, torch.mm, "
             "torch.matmul, @ with a dense matrix, or a vector after it; torch.sparse.addmm "
             "and torch.addmm with it first) and what it gives alone (t(), to_dense(), "
             "torch.sparse.sum...)")


def is_sparse(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.layout != torch.strided


def _is_sparse_tensor(value: Any) -> bool:
    # A sparse tensor here is the user's own, never a subclass of the recording's.
    return type(value) is torch.Tensor and value.layout != torch.strided


def _refuse(what: str) -> None:
    raise TraceError(
        f"the step {what}: salus keeps a sparse matrix the step captures (built before "
        f"the step records) as its coordinates and values, and follows {_FOLLOWED}; "
        "make it dense first (to_dense()), or use those products")


class _Parts:
    """A captured sparse matrix's non-zero entries, as dense constants."""

    def __init__(self, matrix: torch.Tensor):
        if matrix.dim() != 2:
            _refuse(f"uses a sparse tensor of {matrix.dim()} dims (sparse matrices only)")
        if matrix.requires_grad:
            _refuse("uses a sparse tensor that requires a gradient (its values would train)")
        with _outside_the_recording():
            coo = matrix.to_sparse_coo().coalesce() if matrix.layout != torch.sparse_coo \
                else matrix.coalesce()
            self.rows, self.cols = coo.indices().clone()
            self.values = coo.values().clone()
        self.shape = tuple(matrix.shape)
        self.dtype = matrix.dtype

    def check_dtype(self, dense: torch.Tensor, what: str) -> None:
        if dense.dtype != self.dtype:
            raise TraceError(f"{what}: the sparse matrix is {self.dtype} and the dense operand "
                             f"{dense.dtype}, which PyTorch refuses too")

    def times(self, dense: torch.Tensor) -> torch.Tensor:
        """``self @ dense`` for a dense matrix or vector."""
        self.check_dtype(dense, "a sparse product")
        if dense.dim() not in (1, 2) or dense.shape[0] != self.shape[1]:
            raise TraceError(f"a sparse product: a {list(self.shape)} sparse matrix cannot "
                             f"multiply a tensor of shape {list(dense.shape)}")
        terms = dense.index_select(0, self.cols)
        terms = terms * (self.values[:, None] if dense.dim() == 2 else self.values)
        out = dense.new_zeros((self.shape[0], *dense.shape[1:]))
        return out.index_add(0, self.rows, terms)

    def times_from_left(self, dense: torch.Tensor) -> torch.Tensor:
        """``dense @ self`` for a dense matrix."""
        self.check_dtype(dense, "a sparse product")
        if dense.dim() != 2 or dense.shape[1] != self.shape[0]:
            raise TraceError(f"a sparse product: a tensor of shape {list(dense.shape)} "
                             f"cannot multiply a {list(self.shape)} sparse matrix")
        terms = dense.index_select(1, self.rows) * self.values[None, :]
        out = dense.new_zeros((dense.shape[0], self.shape[1]))
        return out.index_add(1, self.cols, terms)


_PRODUCTS = {torch.sparse.mm, torch.spmm, torch.mm, torch.matmul, torch.Tensor.mm,
             torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mv, torch.Tensor.mv}
_ADDMM = {torch.sparse.addmm, torch.addmm, torch.Tensor.addmm}


class SparseUse:
    """What a recording met of sparse tensors: the sparse matrices it captured, and how
    many embeddings asked for sparse gradients (recorded with dense ones)."""

    def __init__(self):
        self.captured: list[torch.Tensor] = []
        self.sparse_gradients = 0


_EMBEDDINGS = {F.embedding: inspect.signature(F.embedding),
               F.embedding_bag: inspect.signature(F.embedding_bag)}


class _SparseProducts(TorchFunctionMode):
    """Calls with a sparse tensor among their arguments: products with a dense tensor go
    to the rules above; calls on sparse constants alone (``adj.t()``, ``coalesce()``,
    ``to_dense()``, ``torch.sparse.sum``) run as they are, giving constants; anything
    else is refused."""

    def __init__(self, use: SparseUse):
        super().__init__()
        self._parts: dict[int, _Parts] = {}
        self._use = use

    def _of(self, matrix: torch.Tensor) -> _Parts:
        parts = self._parts.get(id(matrix))
        if parts is None:
            parts = self._parts[id(matrix)] = _Parts(matrix)
        return parts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _EMBEDDINGS:
            return self._embedding(func, args, kwargs)
        # Every call of the recording passes here: the common case first, cheaply.
        if not any(_is_sparse_tensor(v) for v in args) \
                and not (kwargs and any(_is_sparse_tensor(v) for v in kwargs.values())):
            if func in _BUILDS:
                _refuse(f"builds a sparse tensor ({_name(func)}) while it records")
            return func(*args, **kwargs)
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        sparse = [v for v in tensors if is_sparse(v)]
        for matrix in sparse:
            if all(m is not matrix for m in self._use.captured):
                self._use.captured.append(matrix)
        if len(sparse) == len(tensors):
            # Sparse constants alone: what PyTorch gives for them is a constant too.
            with _outside_the_recording():
                return func(*args, **kwargs)
        if func in _PRODUCTS and len(args) == 2 and not kwargs:
            left, right = args
            if is_sparse(left):
                return self._of(left).times(right)
            if func not in (torch.mv, torch.Tensor.mv):
                return self._of(right).times_from_left(left)
        if func in _ADDMM and len(args) == 3 and is_sparse(args[1]) and len(sparse) == 1 \
                and not set(kwargs) - {"beta", "alpha"}:
            beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
            product = self._of(args[1]).times(args[2])
            product = product if alpha == 1 else product * alpha
            if beta == 0:  # PyTorch ignores the input then, NaNs included
                return product
            return (args[0] if beta == 1 else args[0] * beta) + product
        _refuse(f"calls {_name(func)} with a sparse tensor and a dense one")


    def _embedding(self, func, args, kwargs):
        """An embedding that asks for a sparse gradient (``sparse=True``) records with a
        dense one, the gradient's zero rows included: SGD and Adagrad, the optimizers of
        PyTorch's that take a sparse gradient besides SparseAdam, compute the same from
        it (the trace refuses the others, :func:`check_sparse_gradients`)."""
        bound = _EMBEDDINGS[func].bind(*args, **kwargs)
        if bound.arguments.get("sparse"):
            bound.arguments["sparse"] = False
            weight = bound.arguments["weight"]
            self._use.sparse_gradients += bool(weight.requires_grad)
        return func(*bound.args, **bound.kwargs)


def check_sparse_gradients(use_count: int, optimizer: torch.optim.Optimizer, kind: str):
    """Refuses embeddings with sparse gradients under an optimizer that does not take
    them as SGD and Adagrad do (PyTorch's own refuse them too, but SparseAdam, whose lazy
    moments move only the rows a batch looked up: salus does not run it)."""
    if use_count and kind not in ("sgd", "adagrad"):
        raise UnsupportedOptimizerError(
            f"the model has an embedding with sparse=True, whose sparse gradients "
            f"{type(optimizer).__name__} does not take (in eager PyTorch either): salus "
            "follows sparse gradients under SGD and Adagrad, which compute from them what "
            "they compute from dense ones; use sparse=False with this optimizer")


_BUILDS = {torch.sparse_coo_tensor, torch.sparse_csr_tensor, torch.Tensor.to_sparse,
           torch.Tensor.to_sparse_coo, torch.Tensor.to_sparse_csr}


@contextlib.contextmanager
def _outside_the_recording() -> Iterator[None]:
    """PyTorch's own computation on constants, seen by no mode of the recording."""
    with (torch._C.DisableTorchFunction(), torch._C._DisableFuncTorch(),
          _disable_current_modes(), torch.no_grad()):
        yield


def _name(func) -> str:
    name = getattr(func, "__name__", repr(func))
    if getattr(func, "__qualname__", "").startswith(("TensorBase.", "Tensor.")):
        return f"Tensor.{name}"
    return f"{getattr(func, '__module__', None) or 'torch'}.{name}"


@contextlib.contextmanager
def sparse_products_in_the_graph() -> Iterator[SparseUse]:
    """While a step records, products of captured sparse matrices are recorded as gathers
    and index additions over their entries, and embeddings' sparse gradients as dense
    ones (:class:`_SparseProducts`). Yields what the recording met, filled as it
    records."""
    use = SparseUse()
    with _SparseProducts(use):
        yield use
