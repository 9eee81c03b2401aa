"""How scaled-dot-product attention traces: as one fused op each way, never as the score
matrices of its math decomposition.

- Without dropout, PyTorch's own choice on the CPU, its fused flash kernel
  (``_scaled_dot_product_flash_attention_for_cpu`` and its backward), stays whole; for
  grouped-query attention the key and value heads are repeated to the query's first
  (:func:`flash_attention`, :func:`flash_attention_backward`).
- With dropout (``dropout_p`` in (0, 1), as ``nn.MultiheadAttention``, the stock
  ``nn.TransformerEncoder`` and Hugging Face's SDPA models call it while training),
  PyTorch's CPU dispatch falls back to the math decomposition, which forms and keeps every
  score matrix and its dropout mask. While a step records, :func:`attention_with_dropout`
  runs above autograd instead and calls ``_scaled_dot_product_efficient_attention``:
  PyTorch's own fused op with dropout, whose gradient is its fused backward and whose
  ``philox_seed`` output carries the random stream from the forward to the backward.
  salus devices draw the keep-flags from the session's generator (``docs/ops.md``), as
  they do for ``nn.Dropout``; the forward's log-sum-exp is that of the undropped scores.

PyTorch has no CPU kernel for the efficient op. :func:`efficient_attention_on_cpu`
provides one (the math of the op in the input's dtype, keep-flags from a
``torch.Generator`` seeded by the op's seed) while a step records in real mode and while
:meth:`salus.trace.TracedStep.run` executes a traced graph; it leaves a PyTorch that has
its own CPU kernel alone.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator

import torch
from torch._C import DispatchKey

aten = torch.ops.aten

_EFFICIENT = aten._scaled_dot_product_efficient_attention.default
_EFFICIENT_BACKWARD = aten._scaled_dot_product_efficient_attention_backward.default


def kv_groups(query, key) -> int:
    """Query heads per key head: above 1 for grouped-query attention (``enable_gqa``, as
    Llama's SDPA path calls it), where key and value have fewer heads."""
    if query.dim() != 4 or key.dim() != 4 or key.shape[1] in (0, query.shape[1]):
        return 1
    return query.shape[1] // key.shape[1]


def repeat_heads(t, groups: int):
    """``[B, H, S, D]`` with each head repeated ``groups`` times in place (head ``h`` of
    the result is head ``h // groups`` of ``t``), as ``repeat_kv`` and SDPA's GQA do."""
    b, h, s, d = t.shape
    spread = aten.expand.default(aten.unsqueeze.default(t, 2), [b, h, groups, s, d])
    dense = aten.clone.default(spread, memory_format=torch.contiguous_format)
    return aten.view.default(dense, [b, h * groups, s, d])


def flash_attention(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
                    scale=None):
    """The fused flash op with grouped-query attention's key and value heads repeated to
    the query's (the IR's op takes equal heads); as it is otherwise."""
    groups = kv_groups(query, key)
    if groups == 1:
        return NotImplemented
    return aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, repeat_heads(key, groups), repeat_heads(value, groups), dropout_p,
        is_causal, attn_mask=attn_mask, scale=scale)


def flash_attention_backward(grad_out, query, key, value, out, logsumexp, dropout_p,
                             is_causal, *, attn_mask=None, scale=None):
    """Its backward: the repeated heads' key and value gradients summed per group."""
    groups = kv_groups(query, key)
    if groups == 1:
        return NotImplemented
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad_out, query, repeat_heads(key, groups), repeat_heads(value, groups), out,
        logsumexp, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)

    def per_group(t):
        b, hg, s, d = t.shape
        return aten.sum.dim_IntList(aten.view.default(t, [b, hg // groups, groups, s, d]), [2])

    return dq, per_group(dk), per_group(dv)


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _fused_with_dropout(query, key, value, attn_mask, dropout_p, is_causal,
                        enable_gqa) -> bool:
    """Whether a call of ``scaled_dot_product_attention`` runs as the efficient op: a
    dropout strictly between 0 and 1; batched 4-d inputs of one float dtype whose batch,
    lengths and heads agree (fewer key and value heads only with ``enable_gqa``, dividing
    the query's); and a mask (bool, or of the inputs' dtype) that needs no gradient and is
    not given with ``is_causal``. Anything else runs as PyTorch runs it, which computes it
    or refuses it with its own message."""
    if not 0 < dropout_p < 1 or not all(t.dim() == 4 for t in (query, key, value)):
        return False
    if query.dtype not in _FLOATS or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    (b, h, _, e), (bk, hk, s, ek), (bv, hv, sv, _) = query.shape, key.shape, value.shape
    if not (b == bk == bv and e == ek and s == sv and hk == hv and hk > 0):
        return False
    if hk != h and not (enable_gqa and h % hk == 0):
        return False
    if attn_mask is None:
        return True
    return (not is_causal and not attn_mask.requires_grad and attn_mask.dim() <= 4
            and attn_mask.dtype in (torch.bool, query.dtype))


def attention_with_dropout(query, key, value, attn_mask=None, dropout_p=0.0,
                           is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` as the efficient op where it drops (see the
    module's docstring), as PyTorch runs it otherwise."""
    if not _fused_with_dropout(query, key, value, attn_mask, dropout_p, is_causal,
                               enable_gqa):
        return aten.scaled_dot_product_attention.default._op_dk(
            DispatchKey.CompositeImplicitAutograd, query, key, value, attn_mask, dropout_p,
            is_causal, scale=scale, enable_gqa=enable_gqa)
    groups = kv_groups(query, key)
    if groups > 1:
        key, value = repeat_heads(key, groups), repeat_heads(value, groups)
    out, *_ = _EFFICIENT(query, key, value, attn_mask, True, dropout_p, is_causal,
                         scale=scale)
    return out


# --------------------------------------------------------------------------------------
# The efficient op on the CPU, for tracing in real mode and running traced graphs


def _scale(query, scale):
    """The scores' scale: as given, else ``1 / sqrt(E)``."""
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale


def _probabilities(query, key, bias, is_causal, scale):
    """The scores (in f32 or wider) and their softmax, masked and causal as the op's."""
    work = torch.promote_types(query.dtype, torch.float32)
    scores = torch.matmul(query.to(work), key.to(work).transpose(-2, -1)) * _scale(query, scale)
    if is_causal:
        l, s = scores.shape[-2:]
        keep = torch.ones(l, s, dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if bias is not None:
        if bias.dtype == torch.bool:
            scores = scores.masked_fill(~bias, float("-inf"))
        else:
            scores = scores + bias.to(work)
    return scores, torch.softmax(scores, -1)


def _keep_factors(seed, shape, dropout_p, dtype):
    """0 or ``1 / (1 - p)`` per probability, drawn from a generator seeded by ``seed``."""
    generator = torch.Generator().manual_seed(int(seed) & (2**63 - 1))
    keep = torch.rand(shape, generator=generator) < 1 - dropout_p
    return keep.to(dtype) / (1 - dropout_p)


def _efficient_cpu(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                   is_causal=False, *, scale=None):
    scores, probs = _probabilities(query, key, attn_bias, is_causal, scale)
    seed = torch.randint(0, 2**62, (), dtype=torch.int64)
    if dropout_p > 0:
        probs = probs * _keep_factors(seed, probs.shape, dropout_p, probs.dtype)
    out = torch.matmul(probs, value.to(probs.dtype)).to(query.dtype)
    b, h, l, _ = query.shape
    lse = torch.zeros(b, h, -(-l // 32) * 32 if compute_log_sumexp else 0)
    if compute_log_sumexp:
        lse[..., :l] = torch.logsumexp(scores, -1)
    return out, lse, seed, torch.zeros((), dtype=torch.int64)


def _efficient_backward_cpu(grad_out, query, key, value, attn_bias, out, logsumexp,
                            philox_seed, philox_offset, dropout_p, grad_input_mask,
                            is_causal=False, *, scale=None):
    # Written out (a kernel runs below autograd): with the softmax P, the factors F and
    # dP = F (grad_out v^T), dS = P (dP - rowsum(P dP)).
    _, probs = _probabilities(query, key, attn_bias, is_causal, scale)
    work = probs.dtype
    factors = (_keep_factors(philox_seed, probs.shape, dropout_p, work) if dropout_p > 0
               else torch.ones((), dtype=work))
    go, q, k, v = (t.to(work) for t in (grad_out, query, key, value))
    grad_value = torch.matmul((probs * factors).transpose(-2, -1), go)
    dp = torch.matmul(go, v.transpose(-2, -1)) * factors
    ds = probs * (dp - (probs * dp).sum(-1, keepdim=True))
    scale = _scale(query, scale)
    grad_query = torch.matmul(ds, k) * scale
    grad_key = torch.matmul(ds.transpose(-2, -1), q) * scale
    return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype),
            None)


_CPU_KERNELS = threading.Lock()
#: The registration of the CPU kernels and how many blocks are inside
#: :func:`efficient_attention_on_cpu` now (threads, or one inside another).
_cpu_library: list = [None, 0]


@contextlib.contextmanager
def efficient_attention_on_cpu() -> Iterator[None]:
    """CPU kernels for the efficient op and its backward while the block runs (see the
    module's docstring), unless PyTorch has its own. Blocks may nest and run in several
    threads at once: the kernels are registered by the first to enter and taken out by
    the last to leave."""
    with _CPU_KERNELS:
        if _cpu_library[1] == 0 and not torch._C._dispatch_has_kernel_for_dispatch_key(
                _EFFICIENT.name(), "CPU"):
            library = torch.library.Library("aten", "IMPL")
            library.impl(_EFFICIENT, _efficient_cpu, "CPU")
            library.impl(_EFFICIENT_BACKWARD, _efficient_backward_cpu, "CPU")
            _cpu_library[0] = library
        _cpu_library[1] += 1
    try:
        yield
    finally:
        with _CPU_KERNELS:
            _cpu_library[1] -= 1
            if _cpu_library[1] == 0 and _cpu_library[0] is not None:
                _cpu_library[0]._destroy()
                _cpu_library[0] = None
