"""Dense linear algebra of small matrices, written out in IR ops: the Cholesky factor
(``torch.linalg.cholesky``, ``MultivariateNormal``), triangular solves, and the LU
factorization with partial pivoting behind ``linalg.solve``, ``inv``, ``det``,
``slogdet`` and ``logdet``. Each algorithm is unrolled over the matrix's order ``n``
(a handful of ops per row or column), so the graph grows with ``n``; the rules run above
autograd, and their gradients are those of the unrolled algorithm, which are the
analytic ones PyTorch computes (the Cholesky factor's spread over both triangles, as
PyTorch's). Failures LAPACK reports in ``info`` (a matrix that is not positive-definite,
or singular) are computed in the graph, and PyTorch's checks of them fail the
iteration with its message."""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _first_failure(bad: torch.Tensor) -> torch.Tensor:
    """LAPACK's ``info`` from ``bad`` [..., n] (a step that failed): the 1-based position
    of the first failure, 0 where none did, as int32."""
    failed = bad.any(-1)
    first = bad.to(torch.float32).argmax(-1) + 1
    return torch.where(failed, first, torch.zeros_like(first)).to(torch.int32)


def _symmetric_from_lower(a: torch.Tensor) -> torch.Tensor:
    """The symmetric matrix of ``a``'s lower triangle (what LAPACK reads), whose gradient
    reaches ``a`` as that of ``(a + a^T) / 2``: spread evenly over both triangles, as
    PyTorch's Cholesky gradient is. For a symmetric ``a`` both are ``a`` exactly."""
    halves = 0.5 * (a + a.mT)
    lower = torch.tril(a) + torch.tril(a, -1).mT
    return halves + (lower - halves).detach()


def _cholesky_ex(a, *, upper=False, check_errors=False):
    """``linalg_cholesky_ex``: the lower factor ``L`` of ``a = L L^T``, column by column
    (each column the rest of ``a``'s after the columns before it, over its pivot's square
    root), read from the lower triangle (the upper for ``upper``, giving ``L^T``); ``info``
    the order of the first leading minor that is not positive-definite (its pivot not
    positive, or NaN), after which the factor holds NaNs."""
    if upper:
        lower, info = _cholesky_ex(a.mT, check_errors=check_errors)
        return lower.mT, info
    s = _symmetric_from_lower(a)
    n = a.shape[-1]
    rows = torch.arange(n, device=a.device)
    columns, pivots = [], []
    for j in range(n):
        rest = s[..., :, j]
        if columns:
            before = torch.stack(columns, -1)  # [..., n, j]
            rest = rest - (before * before[..., j:j + 1, :]).sum(-1)
        pivot = rest[..., j]
        pivots.append(pivot)
        root = pivot.sqrt()
        below = rest / root.unsqueeze(-1)
        columns.append(torch.where(rows > j, below,
                                   torch.where(rows == j, root.unsqueeze(-1),
                                               torch.zeros_like(below))))
    factor = torch.stack(columns, -1)
    info = _first_failure(~(torch.stack(pivots, -1) > 0))
    if check_errors:
        _check(info, "linalg.cholesky")
    return factor, info


def _substitute(a, b, upper: bool, unitriangular: bool):
    """``X`` with ``a X = b`` for a triangular ``a`` [..., n, n] and ``b`` [..., n, k]
    (batch dims broadcast), row by row: forward substitution for a lower ``a``, backward
    for an upper one; only ``a``'s triangle (less its diagonal for ``unitriangular``) is
    read."""
    n = a.shape[-1]
    order = range(n - 1, -1, -1) if upper else range(n)
    solved: dict[int, torch.Tensor] = {}
    for i in order:
        row = b[..., i:i + 1, :]
        done = sorted(solved)
        if done:
            known = torch.cat([solved[j] for j in done], -2)  # [..., len(done), k]
            lo, hi = done[0], done[-1] + 1
            row = row - a[..., i:i + 1, lo:hi] @ known
        solved[i] = row if unitriangular else row / a[..., i:i + 1, i:i + 1]
    return torch.cat([solved[i] for i in range(n)], -2)


def _solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    """``linalg_solve_triangular``: ``X`` with ``a X = b`` (``X a = b`` unless ``left``)."""
    if not left:
        return _substitute(a.mT, b.mT, not upper, unitriangular).mT
    return _substitute(a, b, upper, unitriangular)


def _triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    """The older ``triangular_solve(b, a)``: the solution of ``a X = b`` (``a^T X = b``
    with ``transpose``) and a copy of ``a``."""
    if transpose:
        a_used, upper = a.mT, not upper
    else:
        a_used = a
    return _substitute(a_used, b, upper, unitriangular), a.clone()


def _lu(a):
    """LU with partial pivoting (LAPACK's ``getrf``), column by column: each column's
    largest magnitude on or below the diagonal (the first of equal ones) becomes the pivot,
    its row swapped in, and the rows below lose their multiples of the pivot row; a column
    with a zero pivot is skipped, as LAPACK does. Returns ``lower`` (unit diagonal),
    ``upper``, the rows' order ``perm`` (row ``i`` of ``L U`` is row ``perm[i]`` of ``a``),
    the permutation's ``sign``, LAPACK's 1-based ``pivots`` (int32) and ``info`` (the
    first zero pivot)."""
    n = a.shape[-1]
    batch = a.shape[:-2]
    rows = torch.arange(n, device=a.device)
    u = a
    perm = rows.expand(*batch, n)
    sign = torch.ones(batch, dtype=a.dtype, device=a.device)
    multipliers: list[torch.Tensor] = []
    chosen, pivots = [], []
    for k in range(n):
        below = torch.where(rows >= k, u[..., :, k].abs(),
                            torch.full_like(u[..., :, k], -1.0))
        p = below.argmax(-1)  # [...]
        chosen.append(p)
        p_ = p.unsqueeze(-1)
        swap = torch.where(rows == k, p_, torch.where(rows == p_, k, rows))
        u = u.gather(-2, swap.unsqueeze(-1).expand(*batch, n, n))
        perm = perm.gather(-1, swap)
        multipliers = [m.gather(-1, swap) for m in multipliers]
        sign = torch.where(p != k, -sign, sign)
        pivot = u[..., k, k]
        pivots.append(pivot)
        zero = pivot == 0
        safe = torch.where(zero, torch.ones_like(pivot), pivot)
        m = torch.where((rows > k) & ~zero.unsqueeze(-1),
                        u[..., :, k] / safe.unsqueeze(-1), torch.zeros_like(u[..., :, k]))
        multipliers.append(m)
        u = u - m.unsqueeze(-1) * u[..., k:k + 1, :]
    upper = torch.triu(u)
    eye = (rows.unsqueeze(-1) == rows).to(a.dtype)
    lower = torch.stack(multipliers, -1) + eye
    info = _first_failure(torch.stack(pivots, -1) == 0)
    lapack_pivots = (torch.stack(chosen, -1) + 1).to(torch.int32)
    return lower, upper, perm, sign, lapack_pivots, info


def _packed(lower, upper):
    # LAPACK's single LU matrix: U on and above the diagonal, L's multipliers below.
    return upper + torch.tril(lower, -1)


def _lu_solve(lower, upper, perm, b):
    rows = b.gather(-2, perm.unsqueeze(-1).expand(*perm.shape, b.shape[-1]))
    return _substitute(upper, _substitute(lower, rows, False, True), True, False)


def _broadcast_pair(a, b):
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a.expand(*batch, *a.shape[-2:]), b.expand(*batch, *b.shape[-2:])


def _linalg_solve_ex(a, b, *, left=True, check_errors=False):
    """``_linalg_solve_ex`` (``torch.linalg.solve``): ``X`` with ``a X = b`` (``X a = b``
    unless ``left``; ``b`` a vector or a batch of vectors where PyTorch takes it as one)
    through ``a``'s LU factors, with them, the pivots and ``info``."""
    vector = b.dim() == 1 or (left and b.dim() == a.dim() - 1 and b.shape == a.shape[:-1])
    rhs = b.unsqueeze(-1) if vector else b
    if not left:
        rhs = rhs.mT
    lower, upper, perm, _, pivots, info = _lu(a if left else a.mT)
    a_b, rhs = _broadcast_pair(a, rhs)
    perm = perm.expand(*a_b.shape[:-1])
    x = _lu_solve(lower, upper, perm, rhs)
    if not left:
        x = x.mT
    if vector:
        x = x.squeeze(-1)
    if check_errors:
        _check(info, "torch.linalg.solve")
    return x, _packed(lower, upper), pivots, info


def _inv_ex(a, *, check_errors=False):
    """``linalg_inv_ex``: the inverse as the solution of ``a X = I``, and ``info``."""
    n = a.shape[-1]
    rows = torch.arange(n, device=a.device)
    eye = (rows.unsqueeze(-1) == rows).to(a.dtype).expand(*a.shape)
    lower, upper, perm, _, _, info = _lu(a)
    if check_errors:
        _check(info, "linalg.inv")
    return _lu_solve(lower, upper, perm, eye), info


def _det(a):
    """``_linalg_det``: the product of ``U``'s diagonal times the permutation's sign."""
    lower, upper, _, sign, pivots, _ = _lu(a)
    diagonal = torch.diagonal(upper, dim1=-2, dim2=-1)
    return sign * diagonal.prod(-1), _packed(lower, upper), pivots


def _slogdet(a):
    """``_linalg_slogdet``: the determinant's sign and the log of its magnitude, from
    ``U``'s diagonal (sign 0 and log -inf for a singular matrix)."""
    lower, upper, _, sign, pivots, _ = _lu(a)
    diagonal = torch.diagonal(upper, dim1=-2, dim2=-1)
    signs = sign * torch.sign(diagonal).prod(-1)
    return signs, diagonal.abs().log().sum(-1), _packed(lower, upper), pivots


_FAILURES = {
    "cholesky": "The factorization could not be completed because the input is not "
                "positive-definite",
    "inv": "The diagonal element is zero, the inversion could not be completed because "
           "the input matrix is singular.",
    "solve": "The solver failed because the input matrix is singular.",
}


def _message(api_name: str) -> str:
    """PyTorch's message for a failure ``info`` reports (less the failing order)."""
    for key in ("inv", "solve", "cholesky"):
        if key in api_name:
            return f"{api_name}: {_FAILURES[key]}"
    return f"{api_name}: The factorization could not be completed (info > 0)."


def _check(info, api_name: str) -> None:
    aten._assert_async.msg(aten.logical_not.default(aten.any.default(info != 0)),
                           _message(api_name))


def _check_errors(info, api_name, *, is_matrix):
    """``_linalg_check_errors``: PyTorch's check of ``info`` after a factorization, as the
    graph's check that every ``info`` is 0, with PyTorch's message."""
    _check(info, api_name)


def _householder_product(a, tau):
    """``linalg_householder_product`` (``orgqr``): the first ``n`` columns of ``H_1 ...
    H_k``, ``H_i = I - tau_i v_i v_i^T`` with ``v_i`` 0 above row ``i``, 1 at it and
    ``a``'s column ``i`` below, applied to the identity's columns from the last
    reflection to the first (``parametrizations.orthogonal``'s Householder map)."""
    m, n = a.shape[-2:]
    rows = torch.arange(m, device=a.device)
    q = (rows.unsqueeze(-1) == torch.arange(n, device=a.device)).to(a.dtype)
    q = q.expand(*a.shape[:-2], m, n)
    for i in reversed(range(tau.shape[-1])):
        column = a[..., :, i]
        v = torch.where(rows > i, column, (rows == i).to(a.dtype)).unsqueeze(-1)  # [.., m, 1]
        q = q - tau[..., i, None, None] * v @ (v.mT @ q)
    return q


# matrix_exp: a Taylor series of this degree after halving the matrix this many times,
# for a 1-norm up to _EXP_NORM: the series' remainder is at most 2^19 / 19! < 5e-12 of
# the result (at the limit; 1e-17 at a fourth of it), far within float32's rounding.
_EXP_DEGREE, _EXP_HALVINGS, _EXP_NORM = 18, 3, 16.0


def _matrix_exp(a):
    """``linalg_matrix_exp`` (``parametrizations.orthogonal``'s default map of a square
    weight): the Taylor series of ``a / 8`` by Horner's rule, squared three times. A
    matrix whose 1-norm exceeds 16, past what the series covers, fails the iteration
    with a message naming the limit."""
    norm = a.abs().sum(-2).amax(-1)
    _assert_all(norm <= _EXP_NORM,
                f"linalg.matrix_exp: salus computes it by a Taylor series after "
                f"{_EXP_HALVINGS} halvings, exact for a matrix 1-norm up to {_EXP_NORM:g}, "
                "and this matrix's is larger")
    n = a.shape[-1]
    eye = (torch.arange(n, device=a.device).unsqueeze(-1)
           == torch.arange(n, device=a.device)).to(a.dtype)
    x = a / 2 ** _EXP_HALVINGS
    result = eye + x / _EXP_DEGREE
    for k in range(_EXP_DEGREE - 1, 0, -1):
        result = eye + (x @ result) / k
    for _ in range(_EXP_HALVINGS):
        result = result @ result
    return result


def _assert_all(condition, message: str) -> None:
    aten._assert_async.msg(aten.logical_not.default(aten.any.default(
        aten.logical_not.default(condition))), message)


def _qr(a, mode="reduced"):
    """``linalg_qr`` by Householder reflections as LAPACK's ``geqrf`` and ``orgqr`` make
    them: for column ``j``, ``v = x - beta e_1`` with ``beta = -sign(x_1) |x|`` (so R's
    diagonal has LAPACK's signs) and ``tau = (beta - x_1) / beta``; a column already zero
    below its diagonal is left (``tau = 0``). ``mode`` "reduced", "complete" or "r"."""
    m, n = a.shape[-2:]
    k = min(m, n)
    rows = torch.arange(m, device=a.device)
    r = a
    vectors, taus = [], []
    for j in range(k):
        x = r[..., :, j]                                          # [.., m]
        below = torch.where(rows > j, x, torch.zeros_like(x))
        head = x[..., j]
        tail = (below * below).sum(-1)
        norm = (head * head + tail).sqrt()
        plain = tail == 0
        beta = torch.where(head >= 0, -norm, norm)
        safe_beta = torch.where(plain, torch.ones_like(beta), beta)
        scale = torch.where(plain, torch.zeros_like(head), 1 / (head - safe_beta))
        v = torch.where(rows == j, torch.ones_like(x), below * scale.unsqueeze(-1))
        tau = torch.where(plain, torch.zeros_like(head), (safe_beta - head) / safe_beta)
        v = v.unsqueeze(-1)                                       # [.., m, 1]
        r = r - tau[..., None, None] * v @ (v.mT @ r)
        vectors.append(v)
        taus.append(tau)
    upper = torch.triu(r)
    if mode == "r":
        return torch.zeros(0, dtype=a.dtype, device=a.device), upper[..., :k, :]
    columns = m if mode == "complete" else k
    q = (rows.unsqueeze(-1) == torch.arange(columns, device=a.device)).to(a.dtype)
    q = q.expand(*a.shape[:-2], m, columns)
    for v, tau in zip(reversed(vectors), reversed(taus)):
        q = q - tau[..., None, None] * v @ (v.mT @ q)
    return q, (upper if mode == "complete" else upper[..., :k, :])
