"""The decomposition table salus traces PyTorch steps with.

Core ATen's decompositions, adjusted to the IR (``proto/salus/v1/ops.txt``): ops the IR
has kernels for stay whole (training-mode batch norm, reflection padding, layer norm's
backward, fused attention), and ops Core ATen keeps whole but the IR has not are written
in IR ops (dropout as ``bernoulli.p`` draws, ``rand``/``randn`` as ``rand_like``,
``max.dim`` as ``argmax`` and a gather, ``topk`` as a sort and a slice, replication and
circular padding as gathers and concatenations, ...): the rules of :mod:`salus.rules`,
by domain. :func:`decomposition_table` says what each entry does, and
:func:`composite_decompositions` installs the rules that must run above autograd;
:mod:`salus.trace` records every step with both.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
from torch._C import DispatchKey
from torch._decomp import core_aten_decompositions
from torch._decomp import decomposition_table as _all_decompositions
from torch._subclasses.fake_tensor import is_fake

from .attention import attention_with_dropout, flash_attention, flash_attention_backward
from .rules.arithmetic import (_acos, _acosh, _addbmm, _addmv, _angle, _any_dims, _asin,
    _asinh, _atanh, _bool_or, _bool_xor, _clamp_tensor, _copysign, _cosh, _div_mode, _exp2,
    _ge_tensor, _hardtanh, _hardtanh_backward, _hypot, _integer_divisor_checked, _isinf,
    _isnan, _le_tensor, _log_base, _logical_or, _logical_xor, _nan_ignoring, _ne_tensor,
    _signbit, _sinh, _sub_scalar, _tan, _vector_norm, _with_number)
from .rules.indexing import (_as_strided, _as_strided_scatter, _bucketize, _diagonal,
    _diagonal_scatter, _embedding_bag, _embedding_bag_backward, _embedding_renorm, _histc,
    _embedding_bag_dense_backward, _index_reduce, _masked_scatter, _masked_scatter_backward,
    _put, _scatter_reduce, _scatter_reduce_autograd, _searchsorted, _slice_backward,
    _slice_scatter)
from .rules.linalg import (_check_errors, _cholesky_ex, _det, _householder_product, _inv_ex,
    _linalg_solve_ex, _matrix_exp, _qr, _slogdet, _solve_triangular, _triangular_solve)
from .rules.order import (_amin, _kthvalue, _logcumsumexp, _max_dim, _median, _median_dim,
    _min_dim, _nanmedian, _nanmedian_dim, _prod, _prod_dim, _running_extreme, _sort, _topk,
    _whole_extreme)
from .rules.pooling import (_adaptive_avg_pool2d, _adaptive_avg_pool3d, _adaptive_max_pool2d,
    _adaptive_max_pool2d_backward, _adaptive_max_pool3d, _antialiased, _avg_pool3d, _max_pool3d,
    _pad_circular, _replication_pad_backward, _unfold)
from .rules.sampling import (_exponential, _multinomial, _native_dropout,
    _normal_functional, _normal_numbers, _normal_tensors, _rand, _rand_like, _randint,
    _randint_like, _randint_like_low, _randint_low, _randn, _randn_like, _randperm,
    _rrelu_with_noise, _rrelu_with_noise_backward, _uniform)
from .rules.special import _erfcx, _i0, _i0e, _i1, _i1e, _log_ndtr
from .rules.recurrent import _lstm
from .rules.sequences import _bilinear, _cdist, _ctc_loss, _pdist

aten = torch.ops.aten


def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    return (aten.var.correction(x, dim, correction=correction, keepdim=keepdim),
            aten.mean.dim(x, dim, keepdim))


def _empty(size, *, dtype=None, layout=None, device=None, pin_memory=None,
           memory_format=None):
    # Uninitialised memory may hold anything: zeros are a valid choice, and ``full`` is an
    # IR op (dropout's mask and SiLU's backward start from an empty tensor).
    return aten.full.default(size, 0, dtype=dtype or torch.get_default_dtype(),
                             layout=layout, device=device, pin_memory=pin_memory)


def _empty_permuted(size, physical_layout, *, dtype=None, layout=None, device=None,
                    pin_memory=None):
    return _empty(size, dtype=dtype, layout=layout, device=device, pin_memory=pin_memory)


_BATCH_NORM_OPS = ("native_batch_norm", "_native_batch_norm_legit",
                   "_native_batch_norm_legit_functional", "_batch_norm_with_update",
                   "_batch_norm_with_update_functional",
                   # eval mode
                   "_native_batch_norm_legit_no_training", "_batch_norm_no_update")


def _batch_norm_whole(decomposition: Callable, train_at: int, data: Sequence[int],
                      stats: Sequence[int], required: Sequence[int],
                      saved: Sequence[int] = ()) -> Callable:
    """``decomposition`` where the IR has no batch-norm op for the call; else the op stays
    whole (``NotImplemented`` tells make_fx to record it): training-mode batch norm whose
    fused kernels make one pass to gather each channel's statistics and one to normalise,
    where the decomposition makes many. ``train_at``: the index of the ``training`` /
    ``train`` flag; ``data``: the arguments shaped like the input (f32, or 16-bit as
    under autocast), of one dtype; ``stats``: the per-channel tensor arguments (f32 or
    None), of which ``required`` (the running or the saved statistics) must be there.
    ``saved``: the forward's saved statistics among ``stats``, which a fake trace gives
    the input's dtype (the meta kernel's; :func:`_kernel_dtypes` makes them f32 after)."""
    def maybe_whole(*args, **kwargs):
        whole = (len(args) > train_at and args[train_at] is True and args[0].dim() >= 2
                 and all(isinstance(args[i], torch.Tensor) for i in data)
                 and args[0].dtype in (torch.float32, torch.bfloat16, torch.float16)
                 and all(args[i].dtype == args[0].dtype for i in data)
                 and all(args[i] is None or (
                     isinstance(args[i], torch.Tensor)
                     and (args[i].dtype == torch.float32
                          or (i in saved and is_fake(args[i])
                              and args[i].dtype == args[0].dtype)))
                         for i in stats)
                 and all(args[i] is not None for i in required))
        return NotImplemented if whole else decomposition(*args, **kwargs)
    return maybe_whole


# Ops the IR has kernels for, whose Core ATen decompositions would replace them with
# gathers: reflection padding becomes ``index.Tensor`` with reflected indices, and its
# backward nine masked gathers of the whole gradient.
_KEPT_WHOLE = ("reflection_pad2d", "reflection_pad2d_backward",
               # Layer norm's backward: one op (a pass over each row, column sums for the
               # weight and bias), where the decomposition takes several passes.
               "native_layer_norm_backward",
               # Attention: one fused op each way (the forward's log-sum-exp feeds the
               # backward), where the decomposition would build every score matrix.
               "_scaled_dot_product_flash_attention_for_cpu",
               "_scaled_dot_product_flash_attention_for_cpu_backward")


def decomposition_table() -> dict:
    """Core ATen's decompositions, without those of the ops of ``_KEPT_WHOLE`` (reflection
    padding, layer norm's backward, fused attention), with batch norm's (its functional
    op stays whole in training where the IR has it, eval mode becomes arithmetic), and
    with the rules of this module for what Core ATen keeps whole and the IR lacks: dropout
    and every random draw (``rand``, ``randn``, ``normal_``, ``uniform_``, ``exponential_``,
    ``randint``, ``randperm``, ``RReLU``'s slopes) from the session's generator, pooling and padding
    variants, ``EmbeddingBag``, ``repeat``, ``unfold``, grouped-query attention, ``sort``
    and ``topk``, ``max``/``min`` along a dim, comparisons and logic of two tensors,
    diagonals, trigonometric and hyperbolic functions, ``scatter_reduce``'s sums and
    means, ``masked_scatter``, running extremes and log-sum-exps (scans), signs,
    ``multinomial``, Bessel functions, ``erfcx`` and ``log_ndtr``, and dense linear
    algebra (Cholesky, triangular solves, LU). Each function's docstring says
    what it writes; :func:`composite_decompositions` adds the rules that must run above
    autograd."""
    table = dict(core_aten_decompositions().items())
    for name in _KEPT_WHOLE:
        packet = getattr(aten, name)
        for overload in packet.overloads():
            table.pop(getattr(packet, overload), None)
    for name in _BATCH_NORM_OPS:
        packet = getattr(aten, name)
        for overload in packet.overloads():
            if overload.endswith("out"):
                continue
            op = getattr(packet, overload)
            if op in _all_decompositions:
                table[op] = _all_decompositions[op]
    # Training-mode batch norm stays whole (forward: input, weight?, bias?, running_mean,
    # running_var, training; backward: grad_out, input, weight?, running stats?, save_mean,
    # save_invstd, train).
    forward = aten._native_batch_norm_legit_functional.default
    table[forward] = _batch_norm_whole(table[forward], 5, (0,), (1, 2, 3, 4), (3, 4))
    backward = aten.native_batch_norm_backward.default
    table[backward] = _batch_norm_whole(table[backward], 7, (0, 1), (2, 5, 6), (5, 6), (5, 6))
    table[aten.var_mean.correction] = _var_mean
    table[aten.adaptive_avg_pool2d.default] = _adaptive_avg_pool2d
    table[aten.native_dropout.default] = _native_dropout
    table[aten.rand_like.default] = _rand_like
    table[aten.clamp.Tensor] = _clamp_tensor
    table[aten.any.dims] = _any_dims
    table[aten.any.default] = _any_dims  # of every element: every dim
    table[aten.unfold.default] = _unfold
    table[aten._scaled_dot_product_flash_attention_for_cpu.default] = flash_attention
    table[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = (
        flash_attention_backward)
    table[aten.randn_like.default] = _randn_like
    table[aten.rand.default] = _rand
    table[aten.randn.default] = _randn
    table[aten.hardtanh.default] = _hardtanh
    table[aten.hardtanh_backward.default] = _hardtanh_backward
    table[aten.slice_backward.default] = _slice_backward
    table[aten.slice_scatter.default] = _slice_scatter
    table.setdefault(aten.linalg_vector_norm.default, _vector_norm)
    # Core ATen keeps these whole; PyTorch's own decompositions are of IR ops (repeat: an
    # expand and a copy; elu and its gradient: expm1, exp and selects).
    for op in (aten.repeat.default, aten.elu.default, aten.elu_backward.default):
        table.setdefault(op, _all_decompositions[op])
    table[aten.isnan.default] = _isnan
    table[aten.scatter_reduce.two] = _scatter_reduce
    table[aten.masked_scatter.default] = _masked_scatter
    table[aten.bucketize.Tensor] = _bucketize
    table[aten.bucketize.Scalar] = _bucketize
    table[aten.searchsorted.Tensor] = _searchsorted
    table[aten.searchsorted.Scalar] = _searchsorted
    table[aten.fmax.default] = _nan_ignoring(aten.maximum.default)
    table[aten.fmin.default] = _nan_ignoring(aten.minimum.default)
    table[aten.hypot.default] = _hypot
    table[aten.cummax.default] = _running_extreme(True)
    table[aten.cummin.default] = _running_extreme(False)
    table[aten.logcumsumexp.default] = _logcumsumexp
    table[aten.masked_scatter_backward.default] = _masked_scatter_backward
    for op in (aten.remainder, aten.fmod):
        table[op.Tensor] = _integer_divisor_checked
        table[op.Scalar] = _with_number(op)
    table[aten.remainder.Scalar_Tensor] = _with_number(aten.remainder)
    table[aten.div.Tensor_mode] = _div_mode
    table[aten.div.Scalar_mode] = _div_mode
    table[aten.sub.Scalar] = _sub_scalar
    table[aten._embedding_bag.default] = _embedding_bag
    table[aten._embedding_bag_forward_only.default] = _embedding_bag
    table[aten._embedding_bag_backward.default] = _embedding_bag_backward
    table[aten._embedding_bag_dense_backward.default] = _embedding_bag_dense_backward
    table[aten.adaptive_max_pool2d.default] = _adaptive_max_pool2d
    table[aten.adaptive_max_pool2d_backward.default] = _adaptive_max_pool2d_backward
    table[aten.empty.memory_format] = _empty
    table[aten.empty_permuted.default] = _empty_permuted
    table[aten.normal_functional.default] = _normal_functional
    for overload in ("Tensor_Tensor", "Tensor_float", "float_Tensor"):
        table[getattr(aten.normal, overload)] = _normal_tensors
    table[aten.normal.float_float] = _normal_numbers
    table[aten.uniform.default] = _uniform
    table[aten.exponential.default] = _exponential
    table[aten.rrelu_with_noise_functional.default] = _rrelu_with_noise
    table[aten.rrelu_with_noise_backward.default] = _rrelu_with_noise_backward
    table[aten.randint.low] = _randint_low
    table[aten.randint.default] = _randint
    table[aten.randint_like.low_dtype] = _randint_like_low
    table[aten.randint_like.default] = _randint_like
    table[aten.randperm.default] = _randperm
    for name, rule in (("tan", _tan), ("sinh", _sinh), ("cosh", _cosh), ("asin", _asin),
                       ("acos", _acos), ("atanh", _atanh), ("asinh", _asinh),
                       ("acosh", _acosh), ("log2", _log_base(2.0)),
                       ("log10", _log_base(10.0)), ("exp2", _exp2)):
        table[getattr(aten, name).default] = rule
    table[aten.sort.default] = _sort
    table[aten.topk.default] = _topk
    table[aten.max.dim] = _max_dim
    table[aten.kthvalue.default] = _kthvalue
    table[aten.median.dim] = _median_dim
    table[aten.median.default] = _median
    table[aten.put.default] = _put
    table[aten.addmv.default] = _addmv
    table[aten.nanmedian.dim] = _nanmedian_dim
    table[aten.nanmedian.default] = _nanmedian
    table[aten.isinf.default] = _isinf
    table[aten.addbmm.default] = _addbmm
    table[aten.min.dim] = _min_dim
    table[aten.amin.default] = _amin
    table[aten.prod.dim_int] = _prod_dim
    table[aten.prod.default] = _prod
    table[aten.max.default] = lambda x: _whole_extreme(aten.amax.default, x)
    table[aten.min.default] = lambda x: _whole_extreme(aten.amin.default, x)
    table[aten.ne.Tensor] = _ne_tensor
    table[aten.ge.Tensor] = _ge_tensor
    table[aten.le.Tensor] = _le_tensor
    table[aten.logical_or.default] = _logical_or
    table[aten.logical_xor.default] = _logical_xor
    table[aten.bitwise_or.Tensor] = _bool_or
    table[aten.bitwise_xor.Tensor] = _bool_xor
    for name in ("replication_pad1d_backward", "replication_pad2d_backward",
                 "replication_pad3d_backward"):
        table[getattr(aten, name).default] = _replication_pad_backward
    table[aten._pad_circular.default] = _pad_circular
    table[aten.diagonal.default] = _diagonal
    table[aten.diagonal_scatter.default] = _diagonal_scatter
    table[aten.multinomial.default] = _multinomial
    for op, rule in ((aten.i0, _i0), (aten.special_i0e, _i0e), (aten.special_i1, _i1),
                     (aten.special_i1e, _i1e), (aten.special_erfcx, _erfcx),
                     (aten.special_log_ndtr, _log_ndtr)):
        table[op.default] = rule
    table[aten.as_strided.default] = _as_strided
    table[aten.embedding_renorm.default] = _embedding_renorm
    table[aten.histc.default] = _histc
    table[aten.as_strided_scatter.default] = _as_strided_scatter
    table[aten.signbit.default] = _signbit
    table[aten.copysign.Tensor] = _copysign
    table[aten.copysign.Scalar] = _copysign
    table[aten.angle.default] = _angle
    table[aten._linalg_check_errors.default] = _check_errors
    table.update(_LINEAR_ALGEBRA)
    return table


# Linear algebra as unrolled algorithms (salus.rules.linalg): above autograd, so that the
# gradient is the algorithm's, and in the table for a step that records no gradient.
_LINEAR_ALGEBRA = {
    aten.linalg_cholesky_ex.default: _cholesky_ex,
    aten.linalg_solve_triangular.default: _solve_triangular,
    aten.triangular_solve.default: _triangular_solve,
    aten._linalg_solve_ex.default: _linalg_solve_ex,
    aten.linalg_inv_ex.default: _inv_ex,
    aten._linalg_det.default: _det,
    aten._linalg_slogdet.default: _slogdet,
    aten.linalg_householder_product.default: _householder_product,
    aten.linalg_matrix_exp.default: _matrix_exp,
    aten.linalg_qr.default: _qr,
}


# Ops no table entry can replace, because they are decided before the dispatcher's tracing
# sees them. CompositeImplicitAutograd ops PyTorch writes out in C++ (circular padding
# becomes strided copies the IR has no op for; bilinear layers and cdist become ops with
# hand-written gradients), and ops whose gradient is a kernel of its own
# (``grid_sampler_2d_backward``): run as Python rules above autograd, their gradient is
# that of the IR ops they are written in. While a step records they run as these rules.
_ABOVE_AUTOGRAD = {
    (aten.lstm.input, DispatchKey.CompositeImplicitAutograd): _lstm,
    (aten.lstm.input, DispatchKey.Autograd): _lstm,
    # Attention with dropout as PyTorch's efficient op (salus.attention).
    (aten.scaled_dot_product_attention.default, DispatchKey.CompositeImplicitAutograd):
        attention_with_dropout,
    (aten._pad_circular.default, DispatchKey.CompositeImplicitAutograd): _pad_circular,
    (aten.bilinear.default, DispatchKey.CompositeImplicitAutograd): _bilinear,
    (aten.cdist.default, DispatchKey.CompositeImplicitAutograd): _cdist,
    (aten.pdist.default, DispatchKey.CompositeImplicitAutograd): _pdist,
    (aten.ctc_loss.IntList, DispatchKey.CompositeImplicitAutograd): _ctc_loss,
    (aten.ctc_loss.Tensor, DispatchKey.CompositeImplicitAutograd): _ctc_loss,
    (aten.max_pool3d_with_indices.default, DispatchKey.Autograd): _max_pool3d,
    (aten.avg_pool3d.default, DispatchKey.Autograd): _avg_pool3d,
    (aten._upsample_bilinear2d_aa.default, DispatchKey.Autograd): _antialiased(False),
    (aten._upsample_bicubic2d_aa.default, DispatchKey.Autograd): _antialiased(True),
    (aten._adaptive_avg_pool3d.default, DispatchKey.Autograd): _adaptive_avg_pool3d,
    (aten.adaptive_max_pool3d.default, DispatchKey.Autograd): _adaptive_max_pool3d,
    # A product's gradient without PyTorch's read of a value; index_reduce as a
    # scatter_reduce (its own gradient reads one too).
    (aten.scatter_reduce.two, DispatchKey.Autograd): _scatter_reduce_autograd,
    (aten.index_reduce.default, DispatchKey.Autograd): _index_reduce,
    # PyTorch's own decomposition (bilinear, nearest and bicubic sampling, every padding
    # mode), in gathers and arithmetic.
    (aten.grid_sampler_2d.default, DispatchKey.Autograd):
        _all_decompositions.get(aten.grid_sampler_2d.default),
    **{(op, DispatchKey.Autograd): rule for op, rule in _LINEAR_ALGEBRA.items()},
}


@contextlib.contextmanager
def composite_decompositions() -> Iterator[None]:
    """Installs the rules of ``_ABOVE_AUTOGRAD`` for the Python dispatcher (which a
    recording enables), setting aside a Python rule PyTorch has for the same op and key
    (its LSTM's), and puts everything back after, so nothing outside a trace changes."""
    keys = [(op, key) for (op, key), rule in _ABOVE_AUTOGRAD.items() if rule is not None]
    set_aside = [(op, key, op.py_kernels.pop(key, None)) for op, key in keys]
    for op, key in keys:
        op.py_impl(key)(_ABOVE_AUTOGRAD[op, key])
    _clear_dispatch_caches(op for op, _ in keys)
    try:
        yield
    finally:
        for op, key, theirs in set_aside:
            op.py_kernels.pop(key, None)
            if theirs is not None:
                op.py_kernels[key] = theirs
        _clear_dispatch_caches(op for op, _ in keys)


def _clear_dispatch_caches(ops) -> None:
    for op in ops:
        cache = getattr(op, "_dispatch_cache", None)
        if cache is not None:
            cache.clear()

