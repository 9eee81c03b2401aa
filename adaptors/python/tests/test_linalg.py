"""Dense linear algebra in training steps (``salus.rules.linalg``): a Gaussian process's
marginal likelihood (``linalg.cholesky``, ``solve_triangular``), a policy's
``MultivariateNormal`` (covariance and precision matrices: log-likelihood, entropy,
reparameterized samples, and its argument checks in the graph), ``linalg.solve`` (left,
right, a vector), ``inv``, ``det``, ``slogdet`` and ``logdet``, ``torch.eye`` in a
step, ``LowRankMultivariateNormal`` (a strided in-place update, ``as_strided``), and
``parametrizations.orthogonal`` (``linalg.householder_product``, ``linalg.matrix_exp``)
and ``linalg.qr``.
Each model trains three Adam steps on salusd, every tensor against float64 by the suite's
rule (harness.py); the rules themselves are checked against LAPACK in float64,
values and gradients; a matrix LAPACK fails on fails the iteration with PyTorch's
message."""

from __future__ import annotations

import pytest
import torch
from harness import assert_built_model_trains_on_salusd_as_eagerly
from torch import nn

import salus.torch as st

F = nn.functional


def _spd(h: torch.Tensor, n: int) -> torch.Tensor:
    """A batch of symmetric positive-definite n x n matrices from the rows of ``h``."""
    a = h[:, :n * 2].reshape(h.shape[0], n, 2)
    return a @ a.mT + torch.eye(n, dtype=h.dtype)


class GaussianProcess(nn.Module):
    """Exact GP regression's negative log marginal likelihood over learned features: an
    RBF kernel's Cholesky factor, ``alpha`` by two triangular solves, the log-determinant
    from the factor's diagonal."""

    def __init__(self):
        super().__init__()
        self.features = nn.Linear(3, 2)
        self.log_scale = nn.Parameter(torch.tensor(0.2))
        self.log_noise = nn.Parameter(torch.tensor(-1.0))

    def forward(self, x, y):
        z = self.features(x)
        k = torch.exp(-torch.cdist(z, z).pow(2) * torch.exp(-self.log_scale))
        k = k + torch.exp(self.log_noise) * torch.eye(x.shape[0], dtype=x.dtype)
        lower = torch.linalg.cholesky(k)
        inner = torch.linalg.solve_triangular(lower, y.unsqueeze(-1), upper=False)
        alpha = torch.linalg.solve_triangular(lower.mT, inner, upper=True)
        log_det = 2 * torch.diagonal(lower).log().sum()
        return 0.5 * (y.unsqueeze(-1) * alpha).sum() + 0.5 * log_det


class GaussianPolicy(nn.Module):
    """A continuous-action policy: a ``MultivariateNormal`` over 3 actions with a learned
    mean and a full covariance (or precision) matrix per state; the loss is the negative
    log-likelihood of the taken actions less an entropy bonus, plus a reparameterized
    sample's penalty."""

    def __init__(self, precision=False):
        super().__init__()
        self.body = nn.Linear(4, 9)
        self.precision = precision

    def forward(self, state, action, noise):
        h = self.body(state)
        matrix = _spd(h[:, 3:], 3)
        dist = torch.distributions.MultivariateNormal(
            h[:, :3], **{"precision_matrix" if self.precision else "covariance_matrix":
                         matrix})
        sample = dist.loc + (dist.scale_tril @ noise.unsqueeze(-1)).squeeze(-1)
        return (-dist.log_prob(action) - 0.01 * dist.entropy()).mean() + sample.pow(2).mean()


class Solves(nn.Module):
    """``linalg.solve`` from the left (a matrix and a vector right-hand side) and the
    right, ``inv``, ``det``, ``slogdet`` and ``logdet`` of learned general matrices (the
    LU factorization with partial pivoting)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 16)
        self.b = nn.Linear(4, 8)

    def forward(self, x):
        a = self.a(x).view(-1, 4, 4) + 3 * torch.eye(4, dtype=x.dtype)
        b = self.b(x).view(-1, 4, 2)
        left = torch.linalg.solve(a, b)
        right = torch.linalg.solve(a, b.mT, left=False)
        vector = torch.linalg.solve(a, b[..., 0])
        sign, log_abs = torch.linalg.slogdet(a)
        return (left.pow(2).sum() + right.sum() + vector.sum() + torch.inverse(a).sum()
                + torch.linalg.det(a).sum() + (sign * log_abs).sum()
                + torch.logdet(a @ a.mT).sum())


class LowRankPolicy(nn.Module):
    """A ``LowRankMultivariateNormal`` over 4 actions (a rank-2 factor and a diagonal),
    whose capacitance matrix PyTorch builds with a strided in-place update of its diagonal
    (``view(-1, m * m)[:, ::m + 1] += 1``), plus a jitter added the same way by hand."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 16)

    def forward(self, state, action):
        h = self.body(state)
        factor = h[:, 4:12].reshape(-1, 4, 2)
        dist = torch.distributions.LowRankMultivariateNormal(h[:, :4], factor,
                                                             h[:, 12:].exp())
        gram = factor.mT @ factor
        gram.view(-1, 4)[:, ::3] += 0.1
        return -dist.log_prob(action).mean() + torch.logdet(gram).mean()


class OrthogonalLayer(nn.Module):
    """Layers kept orthogonal by ``parametrizations.orthogonal``: a tall weight by its
    Householder map (``linalg.householder_product``), a square one by its default, the
    exponential of a skew-symmetric matrix (``linalg.matrix_exp``)."""

    def __init__(self):
        super().__init__()
        orthogonal = nn.utils.parametrizations.orthogonal
        self.tall = orthogonal(nn.Linear(3, 5), orthogonal_map="householder")
        self.square = orthogonal(nn.Linear(5, 5))
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        q, r = torch.linalg.qr(self.tall.weight.T @ self.tall.weight + x[:3, :].T @ x[:3, :])
        return self.head(self.square(self.tall(x @ q).tanh()).tanh()) + r.diagonal().sum()


def _gp():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, generator=g)
    return GaussianProcess(), (x, torch.sin(x.sum(1))), lambda m, x, y: m(x, y)


def _policy(precision):
    def build():
        g = torch.Generator().manual_seed(2)
        batch = (torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g),
                 torch.randn(5, 3, generator=g))
        return GaussianPolicy(precision), batch, lambda m, s, a, n: m(s, a, n)
    return build


def _solves():
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(3))
    return Solves(), (x,), lambda m, x: m(x)


def _low_rank():
    g = torch.Generator().manual_seed(4)
    batch = (torch.randn(5, 3, generator=g), torch.randn(5, 4, generator=g))
    return LowRankPolicy(), batch, lambda m, s, a: m(s, a)


def _orthogonal():
    g = torch.Generator().manual_seed(6)
    batch = (torch.randn(4, 3, generator=g), torch.randn(4, 2, generator=g))
    return OrthogonalLayer(), batch, lambda m, x, y: F.mse_loss(m(x), y)


MODELS = {"gaussian_process": _gp, "policy_covariance": _policy(False),
          "policy_precision": _policy(True), "solves": _solves, "low_rank": _low_rank,
          "orthogonal": _orthogonal}


@pytest.mark.parametrize("name", MODELS)
def test_trains_on_salusd_as_eagerly(daemon, name):
    assert_built_model_trains_on_salusd_as_eagerly(MODELS[name], daemon.address,
                                                   label=f"{name}: ")


def _close(got, want, scale=1.0):
    # The unrolled algorithms and LAPACK round differently; both are backward stable, so
    # in float64 they agree to a small multiple of the condition number times eps.
    bound = 1e4 * torch.finfo(torch.float64).eps * max(scale, want.abs().max().item())
    assert (got - want).abs().max().item() <= bound, (got, want)


def _gradients(rule, reference, *inputs):
    """``rule`` and ``reference`` on copies of ``inputs``: their outputs and the gradients
    of one weighted sum of them."""
    results = []
    for fn in (rule, reference):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        weights = torch.randn(out.shape, dtype=out.dtype,
                              generator=torch.Generator().manual_seed(9))
        (out * weights).sum().backward()
        results.append((out.detach(), [t.grad for t in leaves]))
    return results


@pytest.mark.parametrize("upper", [False, True])
def test_the_cholesky_rule_gives_lapacks_factor_and_gradient(upper):
    """The factor of symmetric matrices, and of non-symmetric ones (only the triangle
    LAPACK reads counts; the gradient spreads over both, as PyTorch's)."""
    from salus.rules.linalg import _cholesky_ex
    g = torch.Generator().manual_seed(0)
    b = torch.randn(3, 5, 5, dtype=torch.float64, generator=g)
    for a in (b @ b.mT + torch.eye(5, dtype=torch.float64), b + 6 * torch.eye(5)):
        (mine, [my_grad]), (theirs, [their_grad]) = _gradients(
            lambda t: _cholesky_ex(t, upper=upper)[0],
            lambda t: torch.linalg.cholesky(t, upper=upper), a)
        _close(mine, theirs)
        _close(my_grad, their_grad)
    a = b @ b.mT
    a[1, 2, 2] = -1.0  # the third leading minor of the second matrix
    info = _cholesky_ex(a, upper=upper)[1]
    assert torch.equal(info, torch.linalg.cholesky_ex(a, upper=upper).info)


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("left", [True, False])
@pytest.mark.parametrize("unitriangular", [False, True])
def test_the_triangular_solve_rule_gives_lapacks_solution_and_gradients(upper, left,
                                                                        unitriangular):
    from salus.rules.linalg import _solve_triangular
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 5, 5, dtype=torch.float64, generator=g) + 4 * torch.eye(5)
    b = torch.randn(2, *((5, 3) if left else (3, 5)), dtype=torch.float64, generator=g)
    options = dict(upper=upper, left=left, unitriangular=unitriangular)
    (mine, my_grads), (theirs, their_grads) = _gradients(
        lambda a, b: _solve_triangular(a, b, **options),
        lambda a, b: torch.linalg.solve_triangular(a, b, **options), a, b)
    _close(mine, theirs)
    for mine, theirs in zip(my_grads, their_grads):
        _close(mine, theirs)


def test_the_lu_rules_give_lapacks_results_and_gradients():
    """Solves (left, right, a vector, broadcast batches), the inverse, the determinant and
    its sign and log, the packed LU factors and LAPACK's pivots; a singular matrix's
    ``info`` and zero determinant."""
    from salus.rules.linalg import _det, _inv_ex, _linalg_solve_ex, _slogdet
    g = torch.Generator().manual_seed(2)
    a = torch.randn(3, 5, 5, dtype=torch.float64, generator=g)
    b = torch.randn(3, 5, 2, dtype=torch.float64, generator=g)
    cases = [
        (lambda a, b: _linalg_solve_ex(a, b)[0], torch.linalg.solve, (a, b)),
        (lambda a, b: _linalg_solve_ex(a, b, left=False)[0],
         lambda a, b: torch.linalg.solve(a, b, left=False), (a, b.mT.contiguous())),
        (lambda a, b: _linalg_solve_ex(a, b)[0], torch.linalg.solve, (a, b[..., 0])),
        (lambda a, b: _linalg_solve_ex(a, b)[0], torch.linalg.solve,
         (a[0], torch.randn(4, 5, 3, dtype=torch.float64, generator=g))),
        (lambda a: _inv_ex(a)[0], torch.linalg.inv, (a,)),
        (lambda a: _det(a)[0], torch.linalg.det, (a,)),
        (lambda a: _slogdet(a)[1], lambda a: torch.linalg.slogdet(a)[1], (a,)),
    ]
    for rule, reference, inputs in cases:
        (mine, my_grads), (theirs, their_grads) = _gradients(rule, reference, *inputs)
        _close(mine, theirs)
        for mine, theirs in zip(my_grads, their_grads):
            _close(mine, theirs)
    assert torch.equal(_slogdet(a)[0], torch.linalg.slogdet(a)[0])
    lu, pivots = _det(a)[1:]
    their_lu, their_pivots = torch.linalg.lu_factor(a)
    _close(lu, their_lu)
    assert torch.equal(pivots, their_pivots)
    singular = torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=torch.float64)
    assert _det(singular)[0].item() == 0.0
    assert _inv_ex(singular)[1].item() == torch.linalg.inv_ex(singular).info.item() == 2


@pytest.mark.parametrize("shape, reflections", [((5, 5), 5), ((6, 4), 4), ((2, 6, 3), 2),
                                                 ((4, 4), 3)])
def test_the_householder_rule_gives_lapacks_product_and_gradients(shape, reflections):
    from salus.rules.linalg import _householder_product
    g = torch.Generator().manual_seed(7)
    a = torch.randn(*shape, dtype=torch.float64, generator=g)
    tau = torch.rand(*shape[:-2], reflections, dtype=torch.float64, generator=g)
    (mine, my_grads), (theirs, their_grads) = _gradients(
        _householder_product, torch.linalg.householder_product, a, tau)
    _close(mine, theirs)
    for mine, theirs in zip(my_grads, their_grads):
        _close(mine, theirs)


@pytest.mark.parametrize("shape", [(5, 5), (6, 4), (4, 6), (2, 5, 3)])
def test_the_qr_rule_gives_lapacks_factors_and_gradients(shape):
    """Q and R with LAPACK's signs in every mode; the reduced factors' gradients (full
    column rank) as PyTorch's."""
    from salus.rules.linalg import _qr
    g = torch.Generator().manual_seed(9)
    a = torch.randn(*shape, dtype=torch.float64, generator=g)
    for mode in ("reduced", "complete", "r"):
        (q, r), (want_q, want_r) = _qr(a, mode), torch.linalg.qr(a, mode)
        _close(r, want_r)
        assert q.shape == want_q.shape
        if mode != "r":
            _close(q, want_q)
    if shape[-2] >= shape[-1]:
        (mine, [my_grad]), (theirs, [their_grad]) = _gradients(
            lambda t: torch.cat([f.flatten(-2) for f in _qr(t)], -1),
            lambda t: torch.cat([f.flatten(-2) for f in torch.linalg.qr(t)], -1), a)
        _close(mine, theirs)
        _close(my_grad, their_grad)


def test_the_matrix_exponential_rule_gives_pytorchs_values_and_gradients():
    """Within float64's rounding for 1-norms up to 8; past the series' limit (16) the
    iteration fails with a message naming it."""
    from salus.rules.linalg import _matrix_exp
    g = torch.Generator().manual_seed(8)
    for scale in (0.01, 0.3, 1.0):
        a = torch.randn(3, 5, 5, dtype=torch.float64, generator=g) * scale
        (mine, [my_grad]), (theirs, [their_grad]) = _gradients(
            _matrix_exp, torch.linalg.matrix_exp, a)
        _close(mine, theirs)
        _close(my_grad, their_grad)
    with pytest.raises(RuntimeError, match="matrix 1-norm up to 16"):
        _matrix_exp(torch.full((4, 4), 5.0, dtype=torch.float64))


@pytest.mark.parametrize("size, stride, offset", [
    ((3,), (4,), 0),            # a 3 x 3 matrix's diagonal, flattened
    ((2, 3), (9, 4), 0),        # the diagonals of two 3 x 3 matrices
    ((2, 2), (1, 3), 1),        # a transposed block at an offset
    ((3, 2), (2, 0), 2),        # a broadcast (stride 0)
])
def test_the_strided_rules_read_and_write_pytorchs_elements(size, stride, offset):
    """``as_strided`` and ``as_strided_scatter`` of a contiguous tensor as a gather and an
    ``index_put`` of its flat positions; dense views in row-major order are left to the
    layout pass (``NotImplemented``)."""
    from salus.rules.indexing import _as_strided, _as_strided_scatter
    x = torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(5))
    assert torch.equal(_as_strided(x, size, stride, offset),
                       torch.as_strided(x, size, stride, offset))
    if 0 not in stride:  # overlapping writes: PyTorch leaves which one lands open
        src = torch.randn(size)
        assert torch.equal(_as_strided_scatter(x, src, size, stride, offset),
                           torch.as_strided_scatter(x, src, size, stride, offset))
    assert _as_strided(x, (3, 3), (3, 1), 9) is NotImplemented
    assert _as_strided(x.mT, size, stride, offset) is NotImplemented


class _Whitened(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(2, 1)

    def forward(self, covariance, x):
        return self.head(torch.linalg.solve_triangular(torch.linalg.cholesky(covariance),
                                                       x, upper=False).mT)


def test_a_matrix_that_is_not_positive_definite_fails_the_iteration_as_pytorch_raises(
        daemon):
    """PyTorch raises ``LinAlgError`` from ``linalg.cholesky``; the traced step checks the
    factorization's ``info`` and the iteration fails with PyTorch's message, the session's
    state unchanged (a step with a positive-definite matrix after it trains); the same
    model serves the whitened inputs as PyTorch computes them."""
    model = _Whitened()
    good = torch.tensor([[2.0, 0.5], [0.5, 1.0]])
    bad = torch.tensor([[1.0, 2.0], [2.0, 1.0]])
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(4))
    y = torch.randn(3, 1, generator=torch.Generator().manual_seed(5))
    message = "linalg.cholesky: The factorization could not be completed"
    with pytest.raises(torch.linalg.LinAlgError, match=message):
        model(bad, x)

    def loss(m, covariance, x, y):
        return F.mse_loss(m(covariance, x), y)

    with st.TrainSession(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                         (good, x, y), loss_of=loss, address=daemon.address) as s:
        before = {k: v.clone() for k, v in s.state_dict().items()}
        with pytest.raises(st.DaemonError, match=message):
            s.step(bad, x, y)
        after = s.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        s.step(good, x, y)
    with st.InferenceSession(model, (good, x), address=daemon.address) as session:
        got, want = session(good, x), model(good, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
