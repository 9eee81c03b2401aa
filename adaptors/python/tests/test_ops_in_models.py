"""Ops that models use beyond the common layers, trained on salusd: ``topk`` (a mixture
of experts' router), ``max``/``min`` along a dim and ``amin`` (a point cloud's pooling),
``sort`` and ``argsort`` (a masked autoencoder's patch shuffle, sorted pooling),
``round``/``floor``/``ceil``/``trunc`` (quantization with a straight-through gradient),
circular and replication padding (``Conv*d(padding_mode=...)``), diagonals (Barlow
Twins' loss), the comparisons ``>=``, ``<=``, ``!=``, ``|``, ``^`` of tensors,
``grid_sample`` (a spatial transformer), ``nn.Bilinear`` and ``torch.cdist`` (metric
learning), 3-d max and average pooling and ``LocalResponseNorm``, the CTC loss, and the
inverse trigonometric and hyperbolic functions (``atan``, ``atan2`` and the rest from
them), NeRF's volume rendering (``cumprod``, ``prod``), ``%``, ``remainder`` and
``fmod`` (wrapped angles, a learned period, the hashing trick's ``ids % buckets``),
``nn.LSTM`` (layers, both directions, projections, given initial states), ``F.pdist``
(a spread regularizer, with a pair at distance 0), the Gaussian negative log-likelihood
(``F.gaussian_nll_loss``, ``nn.GaussianNLLLoss``), and ``median``, ``kthvalue``,
``isinf`` and ``addbmm``, graph message passing (``scatter_reduce`` of every
reduction, ``index_add``, ``index_reduce``), image features merged into token embeddings
(``masked_scatter``), running extremes and a Cox loss (``cummax``, ``cummin``,
``logcumsumexp``), a probit head (``erfinv``, ``erfc``, ``fmax``, ``fmin``, ``hypot``), bucket
embeddings (``bucketize``, ``searchsorted``), a head on unbatched vectors (``addmv``,
``take``, ``nanmedian``), adaptive max pooling of uneven windows,
a learned power (generalized-mean pooling: ``pow`` of two
tensors), ``RReLU`` in evaluation, and ``torch.distributions``' likelihoods, entropies
and KL divergences (with their argument checks, on by default; Beta, Gamma, Poisson and
Dirichlet through ``lgamma``, ``digamma`` and ``polygamma``). Each model trains three
Adam steps on salusd, every tensor against float64 by the suite's rule (harness.py)."""

from __future__ import annotations

import pytest
import torch
from daemon import Daemon
from harness import assert_as_exact_as_pytorch, assert_trains_on_salusd_as_eagerly
from torch import nn

import salus.torch as st

F = nn.functional


class Experts(nn.Module):
    """A mixture of four experts, each token sent to its top two by a learned router whose
    top scores are softmaxed into the mixing weights (as Mixtral's router does); every
    expert runs densely and the chosen outputs are gathered."""

    def __init__(self, width=6, experts=4, k=2):
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.Linear(width, width * experts)
        self.k, self.count, self.width = k, experts, width
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        scores, chosen = self.router(x).topk(self.k, dim=-1)
        weights = scores.softmax(-1)
        outputs = self.experts(x).view(*x.shape[:-1], self.count, self.width)
        picked = outputs.gather(-2, chosen.unsqueeze(-1).expand(*chosen.shape, self.width))
        return self.head((weights.unsqueeze(-1) * picked).sum(-2))


class PointPooling(nn.Module):
    """PointNet's symmetric pooling over points: a per-point MLP, then the largest and
    smallest feature of each channel over the points (``max``/``min`` along a dim, their
    gradient reaching one point each), and ``amin`` of a second branch."""

    def __init__(self):
        super().__init__()
        self.point = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(24, 4)

    def forward(self, points):
        h = self.point(points)
        largest = h.max(dim=1).values
        smallest, _ = torch.min(h, 1)
        low = torch.amin(h.tanh(), dim=1)
        return self.head(torch.cat([largest, smallest, low], 1))


class PatchShuffle(nn.Module):
    """A masked autoencoder's encoder input: patches shuffled by ``argsort`` of per-patch
    noise (a batch input here, so eager PyTorch sees the same), the first half kept; then
    a sorted pooling (``sort`` of the features, weighted by rank)."""

    def __init__(self, patches=8, width=5):
        super().__init__()
        self.embed = nn.Linear(width, 6)
        self.keep = patches // 2
        self.rank_weights = nn.Parameter(torch.linspace(1.0, 0.1, self.keep))
        self.head = nn.Linear(6, 3)

    def forward(self, patches, noise):
        order = torch.argsort(noise, dim=1)
        kept = order[:, :self.keep]
        h = self.embed(patches)
        h = h.gather(1, kept.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        ranked = h.sort(dim=1, descending=True).values
        return self.head((ranked * self.rank_weights[:, None]).sum(1))


class Quantized(nn.Module):
    """Fake quantization with a straight-through estimator (``x + (q(x) - x).detach()``):
    rounding half to even, and the floor, ceiling and truncation as features."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        h = self.a(x) * 4
        q = h + (torch.round(h) - h).detach()
        steps = torch.floor(h) - torch.ceil(h) + torch.trunc(h)
        return self.b(q / 4 + steps.detach() * 0.1 + torch.round(h * 0.5) * h)


class Padded(nn.Module):
    """Convolutions with circular and replication padding (1-d and 2-d), as
    ``padding_mode`` asks for them, and ``F.pad`` modes with uneven sides."""

    def __init__(self):
        super().__init__()
        self.circular = nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular")
        self.replicate = nn.Conv2d(3, 3, 3, padding=(1, 2), padding_mode="replicate")
        self.line = nn.Conv1d(2, 2, 3, padding=2, padding_mode="replicate")
        self.head = nn.LazyLinear(4)

    def forward(self, x):
        h = self.replicate(torch.tanh(self.circular(x)))
        h = F.pad(h, (2, 1, 0, 1), mode="circular") + 0.5 * F.pad(h, (2, 1, 0, 1),
                                                                   mode="replicate")
        line = self.line(x.mean(2))
        return self.head(torch.cat([h.flatten(1), line.flatten(1)], 1))


class Redundancy(nn.Module):
    """Barlow Twins' loss on two views: the cross-correlation of the batch-normalised
    embeddings, its diagonal pulled to 1 and the rest to 0."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))
        self.bn = nn.BatchNorm1d(5, affine=False)


def _redundancy_loss(m, a, b):
    c = m.bn(m.net(a)).T @ m.bn(m.net(b)) / a.shape[0]
    on_diagonal = (torch.diagonal(c) - 1).pow(2).sum()
    off_diagonal = (c - torch.diag_embed(torch.diagonal(c))).pow(2).sum()
    return on_diagonal + 0.05 * off_diagonal + torch.diagonal(c, 1).sum() * 0.01


class Masks(nn.Module):
    """Masks from tensor comparisons: ``>=``, ``<=``, ``!=``, ``|`` and ``^``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(4, 6)

    def forward(self, x):
        p, q = self.a(x), self.b(x)
        both = ((p >= q) | (p <= -q)) ^ (p != q.round())
        return torch.where(both, p, q) + torch.where(p >= p.flip(0), q, p)


class SpatialTransformer(nn.Module):
    """A spatial transformer: a localisation layer predicts an affine map per image, and
    the convolved image is resampled on its grid (``affine_grid``, ``grid_sample``:
    bilinear, zero padding; then nearest with border padding)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.loc = nn.Linear(2 * 5 * 6, 6)
        self.head = nn.Linear(2 * 3 * 5 * 6, 4)
        with torch.no_grad():  # start near the identity map
            self.loc.weight.mul_(0.1)
            self.loc.bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0]))

    def forward(self, x):
        theta = self.loc(x.flatten(1)).view(-1, 2, 3)
        grid = F.affine_grid(theta, [x.shape[0], 3, 5, 6], align_corners=False)
        h = torch.tanh(self.conv(x))
        smooth = F.grid_sample(h, grid, align_corners=False)
        nearest = F.grid_sample(h, grid * 0.8, mode="nearest", padding_mode="border",
                                align_corners=True)
        return self.head(torch.cat([smooth, nearest], 1).flatten(1))


class Metric(nn.Module):
    """Metric learning heads: ``nn.Bilinear`` scores of embedding pairs and ``cdist``
    between the batch and learned prototypes (Euclidean, Manhattan, and p = 3), one
    distance of each row to itself 0 (its gradient is 0 there, as PyTorch's)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(5, 4)
        self.pair = nn.Bilinear(4, 4, 3)
        self.prototypes = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        e = torch.tanh(self.embed(x))
        near = -torch.cdist(e, self.prototypes) - 0.1 * torch.cdist(e, self.prototypes, p=1)
        self_distance = torch.cdist(e, e, p=3).mean(1, keepdim=True)
        return self.pair(e, e.flip(0)) + near + self_distance


class Volumes(nn.Module):
    """A 3-d CNN (a medical or video model's blocks): max pooling with and without
    overlap and padding, average pooling in ceil mode without the padding counted, and
    local response normalisation (average pooling across channels)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.pool = nn.MaxPool3d(2)
        self.overlap = nn.MaxPool3d(3, stride=2, padding=1)
        self.average = nn.AvgPool3d((2, 3, 2), stride=2, padding=1, ceil_mode=True,
                                    count_include_pad=False)
        self.norm = nn.LocalResponseNorm(3)
        self.head = nn.LazyLinear(3)

    def forward(self, x):
        h = self.norm(torch.relu(self.conv(x)))
        parts = [self.pool(h), self.overlap(h), self.average(h)]
        return self.head(torch.cat([p.flatten(1) for p in parts], 1))


class Speech(nn.Module):
    """An acoustic model trained with CTC: a convolution over time and a per-frame
    classifier whose log-probabilities (time first) go to ``F.ctc_loss``."""

    def __init__(self, features=4, classes=5):
        super().__init__()
        self.conv = nn.Conv1d(features, 8, 3, padding=1)
        self.out = nn.Linear(8, classes)

    def forward(self, x):  # x: [batch, features, time]
        h = torch.relu(self.conv(x)).transpose(1, 2)
        return self.out(h).log_softmax(-1).transpose(0, 1)


def _ctc_batch(seed, concatenated=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, 10, generator=g)
    targets = torch.randint(1, 5, (3, 4), generator=g)
    targets[0, 1] = targets[0, 0]  # a repeated label: its paths need a blank between
    input_lengths, target_lengths = torch.tensor([10, 8, 6]), torch.tensor([4, 2, 3])
    if concatenated:
        targets = torch.cat([targets[b, :n] for b, n in enumerate(target_lengths.tolist())])
    return x, targets, input_lengths, target_lengths


def _ctc(reduction="mean"):
    def loss_of(m, x, targets, input_lengths, target_lengths):
        return F.ctc_loss(m(x), targets, input_lengths, target_lengths, reduction=reduction,
                          zero_infinity=True)
    return loss_of


class Angles(nn.Module):
    """Geometry heads: an orientation as ``atan2`` of two predicted components, ``asin``
    and ``acos`` of bounded features, ``tan``, the hyperbolic functions and their
    inverses, and base-2 and base-10 logarithms and powers."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(15, 3)

    def forward(self, x):
        h = self.a(x)
        bounded = torch.tanh(h) * 0.9
        parts = [torch.atan2(h[:, :1], h[:, 1:2]), torch.atan(h[:, 2:3]),
                 torch.asin(bounded[:, :2]), torch.acos(bounded[:, 2:4]),
                 torch.tan(bounded[:, 4:5]), torch.sinh(h[:, 5:6]), torch.cosh(h[:, 6:7]),
                 torch.asinh(h[:, 7:8]), torch.atanh(bounded[:, :1]),
                 torch.acosh(1 + h[:, :1] ** 2), torch.log2(1 + h[:, 1:2] ** 2),
                 torch.log10(1 + h[:, 2:3] ** 2), torch.exp2(bounded[:, 3:4])]
        return self.b(torch.cat(parts, 1))


class VolumeRenderer(nn.Module):
    """NeRF's volume rendering along each ray: densities and colours of the samples, the
    transmittance to each sample a ``cumprod`` of ``1 - alpha`` (exclusive, as NeRF
    writes it), the colour the weighted sum; and ``prod`` of a dim and of everything."""

    def __init__(self, samples=6):
        super().__init__()
        self.field = nn.Linear(3, 4)
        self.delta = 1.0 / samples

    def forward(self, points):  # [rays, samples, 3]
        out = self.field(points)
        sigma, colour = torch.relu(out[..., 0]), torch.sigmoid(out[..., 1:])
        alpha = 1 - torch.exp(-sigma * self.delta)
        through = torch.cumprod(1 - alpha + 1e-10, -1)
        through = torch.cat([torch.ones_like(through[:, :1]), through[:, :-1]], -1)
        rgb = ((alpha * through)[..., None] * colour).sum(1)
        return rgb + colour.prod(1) * 0.1 + torch.sigmoid(points).prod() * 0.01


class Periodic(nn.Module):
    """Phases wrapped into a period (``%`` of a number, either sign), ``fmod`` and
    ``remainder`` by a learned period (their gradients by the divisor too, through
    floor and truncating division), a float floor division, and hashed ids: an
    embedding of ``ids % buckets`` and of ``torch.remainder`` by a tensor."""

    def __init__(self, buckets=7):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.period = nn.Parameter(torch.tensor([2.5, 3.5, 1.75, 4.0, 2.25, 3.0]))
        self.table = nn.Embedding(buckets, 6)
        self.buckets = buckets
        self.head = nn.Linear(6, 3)

    def forward(self, x, ids):
        h = self.a(x) * 4
        wrapped = ((h % 6.283) + torch.fmod(h, -1.5) + torch.remainder(h, self.period)
                   + torch.fmod(h, self.period) + (h % -2.0)
                   + 0.1 * torch.div(h, 1.3, rounding_mode="floor"))
        hashed = (self.table(ids % self.buckets)
                  + self.table(torch.remainder(-ids, torch.full_like(ids, self.buckets))))
        return self.head(torch.sin(wrapped) + hashed)


class Recurrent(nn.Module):
    """A sequence classifier: a two-layer bidirectional LSTM (batch first) read at its
    last step, and a one-layer LSTM with a projection (``proj_size``) from learned
    initial states, over the same sequence."""

    def __init__(self):
        super().__init__()
        self.deep = nn.LSTM(5, 6, num_layers=2, bidirectional=True, batch_first=True)
        self.projected = nn.LSTM(5, 6, proj_size=3)
        self.h0 = nn.Parameter(torch.randn(1, 1, 3) * 0.1)
        self.c0 = nn.Parameter(torch.randn(1, 1, 6) * 0.1)
        self.head = nn.Linear(12 + 3 + 6, 3)

    def forward(self, x):
        deep, _ = self.deep(x)
        state = (self.h0.expand(1, x.size(0), 3).contiguous(),
                 self.c0.expand(1, x.size(0), 6).contiguous())
        _, (h, c) = self.projected(x.transpose(0, 1), state)
        return self.head(torch.cat([deep[:, -1], h[0], c[0]], 1))


class MessagePassing(nn.Module):
    """A graph network's layer: each edge's message (from its source node's features) is
    summed (``index_add``), averaged, and taken the largest and smallest of at its
    target node (``scatter_reduce`` with and without the node's own features,
    ``index_reduce``), and a product of squashed messages; nodes no edge reaches keep
    their own."""

    def __init__(self, width=5):
        super().__init__()
        self.message = nn.Linear(4, width)
        self.head = nn.Linear(8 * width, 3)

    def forward(self, x, edges):
        source, target = edges
        h = self.message(x)
        sent = h[source]
        places = target.unsqueeze(1).expand_as(sent)
        zeros = torch.zeros_like(h)
        aggregated = [
            zeros.index_add(0, target, sent),
            h.scatter_reduce(0, places, sent, "mean"),
            zeros.scatter_reduce(0, places, sent, "mean", include_self=False),
            zeros.scatter_reduce(0, places, sent, "amax", include_self=False),
            h.scatter_reduce(0, places, sent, "amin"),
            torch.ones_like(h).scatter_reduce(0, places, 1 + 0.5 * torch.tanh(sent), "prod"),
            h.index_reduce(0, target, sent, "amax"),
            torch.ones_like(h).index_reduce(0, target, 1 + 0.5 * torch.tanh(sent), "prod",
                                            include_self=False),
        ]
        return self.head(torch.cat(aggregated, 1))


class GeneralizedMean(nn.Module):
    """Image retrieval's generalized-mean pooling: each channel's mean of x ^ p, to the
    power 1 / p, with p learned; a randomized leaky ReLU in evaluation (its mean slope)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.p = nn.Parameter(torch.tensor([3.0, 2.0, 1.5, 4.0]))
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.conv(x).abs().clamp(min=1e-3)
        pooled = h.pow(self.p[:, None, None]).mean((2, 3)).pow(1 / self.p)
        return self.head(F.rrelu(pooled, 0.1, 0.3, training=False))


class ImageTokens(nn.Module):
    """A vision-language model's input: token embeddings with each image placeholder's
    replaced, in order, by a projected image patch (``masked_scatter``, as LLaVA merges
    them), then a small head."""

    IMAGE = 9

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.project = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids, patches):
        h = self.embed(ids)
        places = (ids == self.IMAGE).unsqueeze(-1).expand_as(h)
        h = h.masked_scatter(places, self.project(patches))
        return self.head(torch.tanh(h).mean(1))


def _image_tokens(seed):
    """Four sequences of six tokens, two of them image placeholders each (at random
    places), eight patches, a label per sequence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 9, (4, 6), generator=g)
    for row in ids:
        row[torch.randperm(6, generator=g)[:2]] = ImageTokens.IMAGE
    return ids, torch.randn(8, 5, generator=g), torch.randint(0, 3, (4,), generator=g)


class RunningExtremes(nn.Module):
    """Sequence features from running extremes (``cummax``, ``cummin``: a drawdown, a
    running low) and their positions, scored by a head."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.head = nn.Linear(4 * 3, 1)

    def forward(self, x):
        h = self.a(x)                                   # [B, T, 4]
        high, where = h.cummax(1)
        low = h.cummin(1).values
        recent = (where == torch.arange(h.shape[1])[:, None]).float()
        features = torch.cat([h - high, low, recent * h], 2)
        return self.head(features).squeeze(-1)          # a risk score per step


def _cox_loss(m, x, order):
    """Cox's partial likelihood over each sequence's steps (ranked by ``order``): each
    score against the log-sum-exp of the scores at or after it (``logcumsumexp``)."""
    scores = m(x).gather(1, order)
    return -(scores - torch.logcumsumexp(scores.flip(1), 1).flip(1)).mean()


class UnevenPooling(nn.Module):
    """Adaptive max pooling to sizes that do not divide the input's (windows of uneven
    widths, overlapping), in two and one dims."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3)
        self.head = nn.Linear(3 * 12 + 3 * 5, 3)

    def forward(self, x):
        h = self.conv(x)
        pooled = F.adaptive_max_pool2d(h, (3, 4)).flatten(1)
        return self.head(torch.cat([pooled, nn.AdaptiveMaxPool1d(5)(h.mean(2)).flatten(1)], 1))


class Buckets(nn.Module):
    """Values bucketed by fixed and learned-then-sorted boundaries (``bucketize``,
    ``searchsorted``), each bucket's embedding added to a linear layer's output."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.table = nn.Embedding(6, 6)
        self.edges = nn.Parameter(torch.tensor([0.5, -0.5, 1.0, 0.0]))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.a(x)
        first, second = h.detach().t().contiguous()[:2]
        fixed = torch.bucketize(first, torch.tensor([-1.0, 0.0, 1.0]))
        learned = torch.searchsorted(self.edges.detach().sort().values, second, right=True)
        return self.head(torch.tanh(h + self.table(fixed) + self.table(learned)))


class Unbatched(nn.Module):
    """A policy-style head on one unbatched vector per example (``nn.Linear`` of a 1-d
    input: ``addmv``), elements picked by flat position (``torch.take``; its gradient a
    ``put``), and a median that skips missing values (``nanmedian``)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.head = nn.Linear(6 + 3 + 1, 3)

    def forward(self, x):
        h = torch.stack([self.a(row) for row in x])
        picked = torch.take(h, torch.tensor([[0, 3, 5]]) + 6 * torch.arange(x.shape[0])[:, None])
        missing = torch.where(h > 0.8, torch.full_like(h, float("nan")), h)
        return self.head(torch.cat([h, picked, missing.nanmedian(1, keepdim=True).values], 1))


class Probit(nn.Module):
    """A probit head: features squashed into (-1, 1) and mapped to normal quantiles
    (``erfinv``), the normal CDF (``erfc``), NaN-ignoring extremes (``fmax``, ``fmin``)
    and a magnitude (``hypot``)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.head = nn.Linear(18, 3)

    def forward(self, x):
        h = self.a(x)
        quantiles = torch.erfinv(torch.tanh(h) * 0.95) * 2 ** 0.5
        cdf = 0.5 * torch.erfc(-h / 2 ** 0.5)
        left, right = h[:, :3], h[:, 3:]
        extremes = torch.fmax(left, right) + torch.fmin(left, right)
        return self.head(torch.cat([quantiles, cdf, extremes, torch.hypot(left, right)], 1))


def _graph(seed, nodes=7, edges=12):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(nodes, 4, generator=g)
    # Node nodes-1 has no incoming edge; some nodes have several.
    pairs = torch.stack([torch.randint(0, nodes, (edges,), generator=g),
                         torch.randint(0, nodes - 1, (edges,), generator=g)])
    return x, pairs, torch.randint(0, 3, (nodes,), generator=g)


def _spread(m, x, y):
    """Cross-entropy plus the mean pairwise distance of the hidden features (p = 2, 1
    and 3): the first two examples are the same, so one distance is 0, where PyTorch's
    gradient is 0."""
    h = m[0](x)
    spread = sum(F.pdist(h, p).mean() for p in (2.0, 1.0, 3.0))
    return F.cross_entropy(m(x), y) + 0.1 * spread


def _likelihoods(m, x, y, labels):
    """A probabilistic head's losses through ``torch.distributions`` (arguments checked,
    as by default): Normal (and Independent) likelihoods, a KL divergence to the prior,
    Laplace and Student-t likelihoods, a Categorical's likelihood and entropy, and a
    Bernoulli's likelihood."""
    D = torch.distributions
    out = m(x)
    loc, scale = out[:, :2], F.softplus(out[:, 2:4]) + 0.1
    normal = D.Normal(loc, scale)
    categorical = D.Categorical(logits=out[:, 4:7])
    return (-D.Independent(normal, 1).log_prob(y).mean()
            + D.kl_divergence(normal, D.Normal(0.0, 1.0)).mean()
            - D.Laplace(loc, scale).log_prob(y).mean()
            - D.StudentT(3.0, loc, scale).log_prob(y).mean()
            - categorical.log_prob(labels).mean() - 0.1 * categorical.entropy().mean()
            - D.Bernoulli(logits=out[:, 7]).log_prob((labels > 0).float()).mean())


def _concentrations(m, x, y, counts):
    """Likelihoods and entropies that need the gamma family (``lgamma``, ``digamma`` and,
    for their gradients, ``polygamma``): Beta (and its KL divergence to the uniform),
    Gamma, Poisson and Dirichlet."""
    D = torch.distributions
    out = m(x)
    a, b = F.softplus(out[:, :2]) + 0.5, F.softplus(out[:, 2:4]) + 0.5
    beta = D.Beta(a, b)
    return (-beta.log_prob(torch.sigmoid(y)).mean() - 0.1 * beta.entropy().mean()
            + D.kl_divergence(beta, D.Beta(torch.ones_like(a), torch.ones_like(b))).mean()
            - D.Gamma(a, b).log_prob(y.exp()).mean() - D.Poisson(a).log_prob(counts).mean()
            - D.Dirichlet(F.softplus(out[:, 4:7]) + 0.5).log_prob(
                torch.softmax(torch.cat([y, y[:, :1]], 1), -1)).mean())


def _gaussian_nll(m, x, y):
    """A probabilistic regression head: a mean and a variance (softplus) per output; the
    loss per element, and (``full``, summed) with one variance per example."""
    out = m(x)
    mean, var = out[:, :2], F.softplus(out[:, 2:]) + 0.01
    return (F.gaussian_nll_loss(mean, y, var)
            + nn.GaussianNLLLoss(full=True, reduction="sum")(mean, y, var.mean(-1)))


class OrderStatistics(nn.Module):
    """Robust pooling: the median and the second smallest of each row's features, the
    median of the whole batch (a constant offset), a sum of products over a batch of
    blocks (``addbmm``), and infinite features masked out (``isinf``; its special values
    in the test below)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.head = nn.Linear(8 + 2 + 4, 3)

    def forward(self, x):
        h = self.a(x)
        median, _ = h.median(1, keepdim=True)
        second = h.kthvalue(2, 1, keepdim=True).values
        blocks = torch.addbmm(h[:2, :2], h.view(-1, 2, 4), h.view(-1, 4, 2), beta=0.5)
        kept = torch.where(torch.isinf(h[:, :4]), torch.zeros_like(h[:, :4]), h[:, :4])
        pooled = blocks.reshape(1, 4).expand(x.size(0), 4) * 0.1 + kept
        # The whole batch's median, its gradient left out: PyTorch spreads it over the
        # elements equal to the median, which the yardstick's rounded runs make none.
        centred = h - torch.median(h.detach())
        return self.head(torch.cat([centred, median, second, pooled], 1))


def _batch(*shapes, seed, classes=None):
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(*shape, generator=g) for shape in shapes]
    if classes is not None:
        tensors.append(torch.randint(0, classes[1], (classes[0],), generator=g))
    return tuple(tensors)


def _classify(m, *batch):
    *inputs, labels = batch
    return F.cross_entropy(m(*inputs), labels)


MODELS = {
    "topk_router": lambda: (Experts(), _batch((5, 6), seed=1, classes=(5, 3)), _classify),
    "max_min_pooling": lambda: (PointPooling(), _batch((3, 7, 3), seed=2, classes=(3, 4)),
                                _classify),
    "argsort_and_sort": lambda: (PatchShuffle(), _batch((4, 8, 5), (4, 8), seed=3,
                                                        classes=(4, 3)), _classify),
    "rounding": lambda: (Quantized(), _batch((6, 5), seed=4, classes=(6, 3)), _classify),
    "circular_and_replicate_padding": lambda: (
        Padded(), _batch((2, 2, 5, 6), seed=5, classes=(2, 4)), _classify),
    "diagonals": lambda: (Redundancy(), _batch((8, 6), (8, 6), seed=6), _redundancy_loss),
    "tensor_comparisons": lambda: (Masks(), _batch((5, 4), (5, 6), seed=7),
                                   lambda m, x, y: F.mse_loss(m(x), y)),
    "grid_sample": lambda: (SpatialTransformer(), _batch((2, 2, 5, 6), seed=8,
                                                         classes=(2, 4)), _classify),
    "bilinear_and_cdist": lambda: (Metric(), _batch((6, 5), seed=9, classes=(6, 3)),
                                   _classify),
    "pooling_3d": lambda: (Volumes(), _batch((2, 2, 4, 6, 5), seed=11, classes=(2, 3)),
                           _classify),
    "ctc_loss": lambda: (Speech(), _ctc_batch(12), _ctc()),
    "ctc_loss_concatenated_sum": lambda: (Speech(), _ctc_batch(13, concatenated=True),
                                          _ctc("sum")),
    "volume_rendering": lambda: (VolumeRenderer(), _batch((5, 6, 3), (5, 3), seed=15),
                                 lambda m, x, y: F.mse_loss(m(x), y)),
    "angles": lambda: (Angles(), _batch((6, 4), seed=14, classes=(6, 3)), _classify),
    "pdist": lambda: (nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)),
                      (lambda x, y: (torch.cat([x[:1], x[:1], x[2:]]), y))(
                          *_batch((6, 4), seed=19, classes=(6, 3))), _spread),
    "gaussian_nll": lambda: (nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)),
                             _batch((6, 4), (6, 2), seed=20), _gaussian_nll),
    "order_statistics": lambda: (OrderStatistics(), _batch((4, 4), seed=21, classes=(4, 3)),
                                 _classify),
    "lstm": lambda: (Recurrent(), _batch((4, 7, 5), seed=18, classes=(4, 3)), _classify),
    "message_passing": lambda: (MessagePassing(), _graph(22), _classify),
    "image_tokens": lambda: (ImageTokens(), _image_tokens(26), _classify),
    "probit": lambda: (Probit(), _batch((6, 4), seed=28, classes=(6, 3)), _classify),
    "buckets": lambda: (Buckets(), _batch((8, 4), seed=30, classes=(8, 3)), _classify),
    "unbatched": lambda: (Unbatched(), _batch((5, 4), seed=31, classes=(5, 3)), _classify),
    "uneven_adaptive_max_pooling": lambda: (UnevenPooling(), _batch((2, 2, 9, 12), seed=29,
                                                                   classes=(2, 3)), _classify),
    "running_extremes": lambda: (RunningExtremes(), (
        torch.randn(4, 9, 3, generator=torch.Generator().manual_seed(27)),
        torch.stack([torch.randperm(9, generator=torch.Generator().manual_seed(k))
                     for k in range(4)])), _cox_loss),
    "distributions": lambda: (nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)),
                              _batch((6, 4), (6, 2), seed=24, classes=(6, 3)),
                              _likelihoods),
    "gamma_family": lambda: (nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 7)),
                             (*_batch((6, 4), (6, 2), seed=25),
                              torch.randint(0, 5, (6, 2),
                                            generator=torch.Generator().manual_seed(25))
                              .float()), _concentrations),
    "generalized_mean": lambda: (GeneralizedMean(), _batch((3, 2, 5, 5), seed=23,
                                                          classes=(3, 3)), _classify),
    "remainder_and_fmod": lambda: (Periodic(), (
        *_batch((6, 4), seed=16)[:1],
        torch.randint(-1000, 1000, (6,), generator=torch.Generator().manual_seed(16)),
        torch.randint(0, 3, (6,), generator=torch.Generator().manual_seed(17))), _classify),
    # Over 25 rows a side: PyTorch's Euclidean distances through a matrix product.
    "cdist_by_product": lambda: (Metric(), _batch((30, 5), seed=10, classes=(30, 3)),
                                 _classify),
}


@pytest.fixture(scope="module")
def daemon():
    with Daemon("--memory", "256MiB") as d:
        yield d


@pytest.mark.parametrize("name", MODELS)
def test_trains_on_salusd_as_eagerly(daemon, name):
    torch.manual_seed(0)
    model, batch, loss_of = MODELS[name]()
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters()):
        model(*batch[:-1])  # LazyLinear: its size from one forward pass
    assert_trains_on_salusd_as_eagerly(model, batch, loss_of,
                                       lambda p: torch.optim.Adam(p, lr=1e-2),
                                       daemon.address, label=f"{name}: ")


POOLS_3D = [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1),
            dict(kernel_size=(3, 2, 2), stride=(2, 1, 2), padding=(1, 0, 1), ceil_mode=True),
            dict(kernel_size=2, ceil_mode=True)]


@pytest.mark.parametrize("args", POOLS_3D)
def test_3d_pooling_rules_give_pytorchs_values_and_indices(args):
    from salus.decompositions import _avg_pool3d, _max_pool3d
    x = torch.randn(2, 3, 7, 6, 5, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    # Sums of a window in another order: each of its (at most 12) additions rounds once.
    bound = 12 * torch.finfo(torch.float64).eps * x.abs().max().item()
    values, indices = _max_pool3d(x, **args)
    want_values, want_indices = F.max_pool3d(x, return_indices=True, **args)
    assert torch.equal(values, want_values) and torch.equal(indices, want_indices)
    dilated = _max_pool3d(x, **args, dilation=(1, 2, 1))
    assert torch.equal(dilated[1], F.max_pool3d(x, return_indices=True, dilation=(1, 2, 1),
                                                 **args)[1])
    for count_include_pad in (True, False):
        got = _avg_pool3d(x, **args, count_include_pad=count_include_pad)
        want = F.avg_pool3d(x, **args, count_include_pad=count_include_pad)
        torch.testing.assert_close(got, want, rtol=0, atol=bound)
    torch.testing.assert_close(_avg_pool3d(x, **args, divisor_override=3),
                               F.avg_pool3d(x, **args, divisor_override=3), rtol=0,
                               atol=bound)


def test_the_ctc_rule_gives_pytorchs_losses_and_gradients():
    """In float64, against PyTorch's own CTC (its closed-form gradient): every reduction,
    padded and concatenated targets, lengths as lists and tensors, a sample too short for
    its target (infinite, or 0 with ``zero_infinity``), and an unbatched input."""
    from salus.decompositions import _ctc_loss
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 4, 6, dtype=torch.float64, generator=g, requires_grad=True)
    log_probs = logits.log_softmax(2)
    targets = torch.randint(1, 6, (4, 5), generator=g)
    targets[1, 2] = targets[1, 1]
    # Sample 3: 2 frames for the labels "a a", which need 3 (a, blank, a).
    targets[3, 1] = targets[3, 0]
    inputs, lengths = [12, 10, 7, 2], [5, 3, 4, 2]
    concatenated = torch.cat([targets[b, :n] for b, n in enumerate(lengths)])
    # Float64 sums of up to 12 steps of log-sum-exp over 3 terms: 1e-12 is far above
    # their rounding (about 1e-15) and far below any difference in the recursion.
    for reduction in ("none", "mean", "sum"):
        for zero_infinity in (False, True):
            for t in (targets, concatenated):
                for lens in ((inputs, lengths), (torch.tensor(inputs), torch.tensor(lengths))):
                    want = F.ctc_loss(log_probs, t, *lens, reduction=reduction,
                                      zero_infinity=zero_infinity)
                    got = _ctc_loss(log_probs, t, *lens, 0,
                                    ["none", "mean", "sum"].index(reduction), zero_infinity)
                    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
                    if want.isfinite().all():
                        grads = [torch.autograd.grad(v.sum(), logits, retain_graph=True)[0]
                                 for v in (got, want)]
                        torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)
    single = torch.randn(8, 5, dtype=torch.float64, generator=g).log_softmax(1)
    label = torch.tensor([1, 2, 2])
    torch.testing.assert_close(_ctc_loss(single, label, [8], [3]),
                               F.ctc_loss(single, label, [8], [3]), rtol=0, atol=1e-12)


def test_the_trigonometric_rules_are_as_precise_as_pytorchs_functions():
    """Each rule (``tan`` as ``sin / cos``, ``asin`` through ``atan2``, ``atanh`` through
    ``log1p``, ...) in float32 against the function in float64, over its domain with
    values near 0 and near its edges: within 2 float32 epsilons of relative error, as
    PyTorch's own float32 functions are (a rule of a few correctly rounded steps)."""
    from salus import decompositions as d
    inside = torch.cat([torch.linspace(-0.999, 0.999, 2001),
                        torch.tensor([0.0, -0.0, 1e-8, -1e-8, 0.5, -0.5])])
    wide = torch.cat([torch.linspace(-30, 30, 2001), torch.tensor([1e-8, -1e-8, 1e10, -1e10])])
    above = torch.cat([torch.linspace(1.0, 30, 2001), torch.tensor([1 + 2 ** -20, 1e10])])
    cases = [(d._tan, torch.tan, inside), (d._sinh, torch.sinh, wide),
             (d._cosh, torch.cosh, wide), (d._asin, torch.asin, inside),
             (d._acos, torch.acos, inside), (d._atanh, torch.atanh, inside),
             (d._asinh, torch.asinh, wide), (d._acosh, torch.acosh, above),
             (d._log_base(2.0), torch.log2, above), (d._log_base(10.0), torch.log10, above),
             (d._exp2, torch.exp2, wide)]
    eps = torch.finfo(torch.float32).eps
    for rule, function, x in cases:
        got, want = rule(x).double(), function(x.double())
        finite = want.isfinite() & (want != 0)
        error = ((got - want).abs()[finite] / want.abs()[finite]).max().item()
        assert error <= 2 * eps, (function.__name__, error / eps)
        assert torch.equal(got[~finite].isnan(), want[~finite].isnan()), function.__name__


def test_an_integer_remainder_by_zero_fails_the_iteration_as_pytorch_raises(daemon):
    """Of two integer tensors, a zero divisor: PyTorch raises ``ZeroDivisionError``; the
    traced step checks the divisor and the iteration fails with that message, the
    session's state unchanged (a step with nonzero divisors after it trains)."""
    model = Periodic()
    buckets = torch.tensor([7, 5, 3, 7, 5, 3])

    def loss(m, x, ids, divisors, y):
        hashed = m.table(torch.remainder(ids, divisors))
        return F.cross_entropy(m.head(m.a(x) + hashed), y)

    x = torch.randn(6, 4)
    ids = torch.tensor([10, -11, 12, 13, -14, 15])
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        torch.remainder(ids, buckets * 0)
    with st.TrainSession(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                         (x, ids, buckets, y), loss_of=loss, address=daemon.address) as s:
        before = {k: v.clone() for k, v in s.state_dict().items()}
        with pytest.raises(st.DaemonError, match="ZeroDivisionError"):
            s.step(x, ids, torch.tensor([7, 0, 3, 7, 5, 3]), y)
        after = s.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        s.step(x, ids, buckets, y)


def test_a_negative_variance_fails_the_iteration_as_pytorch_raises(daemon):
    """``F.gaussian_nll_loss`` raises ``ValueError`` on a negative variance, checked in
    Python; the traced step checks it in the graph, and the iteration fails with
    PyTorch's message, the session's state unchanged."""
    model = nn.Linear(4, 2)

    def loss(m, x, y, var):
        return F.gaussian_nll_loss(m(x), y, var)

    x, y = torch.randn(5, 4), torch.randn(5, 2)
    var = torch.full((5, 2), 0.5)
    with st.TrainSession(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                         (x, y, var), loss_of=loss, address=daemon.address) as s:
        before = {k: v.clone() for k, v in s.state_dict().items()}
        bad = var.clone()
        bad[2, 1] = -0.5
        with pytest.raises(ValueError, match="var has negative entry"):
            F.gaussian_nll_loss(model(x), y, bad)
        with pytest.raises(st.DaemonError, match="var has negative entry"):
            s.step(x, y, bad)
        after = s.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        s.step(x, y, var)


def test_a_distributions_argument_check_fails_the_iteration_as_pytorch_raises(daemon):
    """``torch.distributions`` checks each parameter against its constraint and each
    value against the support in Python (``validate_args``), raising ``ValueError``; the
    traced step checks both in the graph, and the iteration fails naming the parameter
    or the value, the distribution and the constraint, the session's state unchanged."""
    D = torch.distributions
    model = nn.Linear(4, 2)

    def loss(m, x, scale, value):
        return -D.Normal(m(x), scale).log_prob(value).mean()

    x, scale, value = torch.randn(5, 4), torch.full((5, 2), 0.5), torch.randn(5, 2)
    bad_scale = scale.clone()
    bad_scale[3, 0] = -1.0
    with pytest.raises(ValueError, match="Expected parameter scale"):
        loss(model, x, bad_scale, value)
    with st.TrainSession(model, None, torch.optim.SGD(model.parameters(), lr=0.1),
                         (x, scale, value), loss_of=loss, address=daemon.address) as s:
        before = {k: v.clone() for k, v in s.state_dict().items()}
        with pytest.raises(st.DaemonError, match=r"Expected parameter scale \(Tensor of "
                           r"shape \(5, 2\)\) of distribution Normal to satisfy the "
                           r"constraint GreaterThan\(lower_bound=0.0\)"):
            s.step(x, bad_scale, value)
        with pytest.raises(st.DaemonError, match="Expected value argument .* support"):
            s.step(x, scale, torch.full((5, 2), float("nan")))
        after = s.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        s.step(x, scale, value)


def test_isinf_median_and_kthvalue_rules_give_pytorchs_results():
    """The rules behind ``isinf`` (signed infinities, NaN, integers), ``median`` (a NaN in
    a slice gives its first NaN and that position; the lower median otherwise),
    ``nanmedian``,
    ``kthvalue``, and ``max``/``min`` along a dim of bools, against PyTorch's own
    results."""
    from salus import decompositions as d
    special = torch.tensor([1.0, float("inf"), -float("inf"), float("nan"), 0.0])
    assert torch.equal(d._isinf(special), torch.isinf(special))
    assert torch.equal(d._isinf(torch.arange(4)), torch.isinf(torch.arange(4)))
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(4))
    x[1, 3] = x[4, 2] = x[4, 5] = float("nan")
    for dim in (0, 1):
        for keepdim in (False, True):
            got, want = d._median_dim(x, dim, keepdim), torch.median(x, dim, keepdim)
            assert torch.equal(got[0].nan_to_num(7.0), want.values.nan_to_num(7.0))
            assert torch.equal(got[1], want.indices)
            for k in (1, 4):
                got = d._kthvalue(x.nan_to_num(0.0), k, dim, keepdim)
                want = torch.kthvalue(x.nan_to_num(0.0), k, dim, keepdim)
                assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)
    assert d._median(x).isnan() and d._median(x.nan_to_num(0.0)) == torch.median(
        x.nan_to_num(0.0))
    # nanmedian: the lower median of the numbers and its position; a slice of NaNs gives
    # NaN (which NaN's position PyTorch gives is left open).
    x[0] = float("nan")
    for dim in (0, 1):
        got, want = d._nanmedian_dim(x, dim, True), torch.nanmedian(x, dim, True)
        assert torch.equal(got[0].nan_to_num(7.0), want.values.nan_to_num(7.0))
        numbers = want.values.isfinite()
        assert torch.equal(got[1][numbers], want.indices[numbers])
    assert d._nanmedian(x) == torch.nanmedian(x)
    # max and min along a dim of bools (a constraint's check: every diagonal positive).
    mask = x.nan_to_num(0.0) > -0.5
    for rule, reference in ((d._max_dim, torch.max), (d._min_dim, torch.min)):
        got, want = rule(mask, 1), reference(mask, 1)
        assert torch.equal(got[0], want.values) and torch.equal(got[1], want.indices)


class _Scatters(nn.Module):
    """``scatter_reduce`` along dim 1 by each reduction, with and without self."""

    def forward(self, x, index, src):
        return torch.stack([x.scatter_reduce(1, index, src, reduce, include_self=include)
                            for reduce in ("sum", "prod", "mean", "amax", "amin")
                            for include in (True, False)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_scatter_reduce_serves_pytorchs_values(daemon, dtype):
    """Every reduction of ``scatter_reduce``, with self and without, of floats (a NaN in
    self and in src, ties) and of integers (a mean rounding down), as PyTorch computes
    them; an index smaller than src, places named several times and none."""
    g = torch.Generator().manual_seed(6)
    x = torch.randint(-4, 5, (3, 6), generator=g).to(dtype)
    src = torch.randint(-4, 5, (3, 7), generator=g).to(dtype)
    if dtype.is_floating_point:
        x, src = x + torch.rand(3, 6, generator=g), src * 0.75
        x[0, 1], src[2, 3] = float("nan"), float("nan")
    index = torch.randint(0, 5, (3, 5), generator=g)
    model = _Scatters()
    with st.InferenceSession(model, (x, index, src), address=daemon.address) as session:
        got, want = session(x, index, src), model(x, index, src)
    assert got.dtype == want.dtype
    if dtype.is_floating_point:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0, equal_nan=True)
    else:
        assert torch.equal(got, want)


def test_the_scan_and_nan_ignoring_rules_give_pytorchs_results():
    """``cummax`` and ``cummin`` by doubling give PyTorch's values and positions (ties:
    the later; a NaN stays, at the last NaN's position; infinities; bools and integers);
    ``logcumsumexp`` is as close to float64 as PyTorch's running sum, by the suite's
    rule, over a long line of wide values, and has its NaNs and -infs; ``fmax``,
    ``fmin`` and ``hypot`` give PyTorch's special values; ``bucketize`` and
    ``searchsorted`` give PyTorch's insertion points; adaptive max pooling of uneven
    windows gives PyTorch's values, indices (the first of equal maxima) and gradient."""
    from salus import decompositions as d
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 9, generator=g).round()
    x[1, 3] = x[2, 0] = x[2, 5] = float("nan")
    x[3, 4], x[4] = float("-inf"), float("-inf")
    flags, ints = torch.rand(4, 6, generator=g) > 0.5, torch.randint(-3, 3, (4, 7), generator=g)
    for rule, reference in ((d._running_extreme(True), torch.cummax),
                            (d._running_extreme(False), torch.cummin)):
        for t, dim in ((x, 0), (x, 1), (flags, 1), (ints, 1), (ints, -1)):
            values, positions = rule(t, dim)
            want = reference(t, dim)
            assert torch.equal(values.nan_to_num(99.0), want.values.nan_to_num(99.0))
            assert torch.equal(positions, want.indices)
    wide = torch.randn(3, 1000, generator=g) * 30
    assert_as_exact_as_pytorch({"out": d._logcumsumexp(wide, 1)},
                               {"out": torch.logcumsumexp(wide.double(), 1)},
                               {"out": torch.logcumsumexp(wide, 1)}, label="logcumsumexp: ")
    # fmax, fmin and hypot with NaNs, signed zeros, infinities, overflow, subnormals.
    a = torch.tensor([1.0, float("nan"), 2.0, float("nan"), -0.0, 3e38, 1e-40, float("inf")])
    b = torch.tensor([2.0, 1.0, float("nan"), float("nan"), 0.0, 3e38, 1e-40, float("nan")])
    for rule, reference in ((d._nan_ignoring(torch.ops.aten.maximum.default), torch.fmax),
                            (d._nan_ignoring(torch.ops.aten.minimum.default), torch.fmin)):
        assert torch.equal(rule(a, b).nan_to_num(7.0), reference(a, b).nan_to_num(7.0))
    got, want = d._hypot(a, b), torch.hypot(a, b)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got[[0, 4, 6]], want[[0, 4, 6]])
    # Insertion points: ties either side, NaN last, infinities, batched sequences, a
    # sorter, integers, int32 results.
    edges = torch.tensor([-1.0, 0.0, 0.0, 2.0])
    points = torch.tensor([float("nan"), -5, -1, 0, 1, 2, 3, float("inf"), float("-inf")])
    for right in (False, True):
        assert torch.equal(d._bucketize(points, edges, right=right),
                           torch.bucketize(points, edges, right=right))
        side = "right" if right else "left"
        assert torch.equal(d._searchsorted(edges, points, side=side, out_int32=True),
                           torch.searchsorted(edges, points, side=side, out_int32=True))
    lines, values = torch.tensor([[5.0, 1, 3], [6, 2, 4]]), torch.tensor([[3.0, 6], [1, 7]])
    order = lines.argsort(-1)
    assert torch.equal(d._searchsorted(lines, values, sorter=order, right=True),
                       torch.searchsorted(lines, values, sorter=order, right=True))
    ids = torch.tensor([0, 1, 2, 5])
    assert torch.equal(d._bucketize(ids, torch.tensor([1, 3])),
                       torch.bucketize(ids, torch.tensor([1, 3])))
    # Adaptive max pooling of uneven windows: PyTorch's values, indices and gradient.
    planes = torch.randn(2, 3, 7, 10, generator=g).round()  # ties
    for size in ((3, 4), (5, 7), (7, 10), (4, 6)):
        values, indices = d._adaptive_max_pool2d(planes, size)
        want, want_indices = torch.ops.aten.adaptive_max_pool2d.default(planes, size)
        assert torch.equal(values, want) and torch.equal(indices, want_indices)
        grad = torch.randn_like(want)
        torch.testing.assert_close(
            d._adaptive_max_pool2d_backward(grad, planes, indices),
            torch.ops.aten.adaptive_max_pool2d_backward.default(grad, planes, indices))
    # NaNs from where a line meets one, -inf for a line of -inf, as PyTorch's.
    got, want = d._logcumsumexp(x, 1), torch.logcumsumexp(x, 1)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())


class _Divisions(nn.Module):
    """Integer floor and truncating division of either sign, by numbers and by a tensor."""

    def forward(self, ids, divisors):
        return torch.stack([ids // 3, ids // -4, torch.div(ids, 5, rounding_mode="trunc"),
                            torch.div(ids, divisors, rounding_mode="floor"),
                            torch.div(ids, divisors, rounding_mode="trunc")])


def test_integer_division_is_pytorchs_and_refuses_what_it_cannot_do_exactly(daemon):
    """``//`` and ``div(rounding_mode=...)`` of integers serve as PyTorch computes them
    (the IR divides exactly through float32 below 2^24); a quotient past that, or a zero
    divisor, fails the request with a message naming it instead of a rounded answer."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(-10**6, 10**6, (64,), generator=g)
    divisors = torch.randint(1, 50, (64,), generator=g) * (torch.randint(0, 2, (64,),
                                                                         generator=g) * 2 - 1)
    model = _Divisions()
    with st.InferenceSession(model, (ids, divisors), address=daemon.address) as session:
        assert torch.equal(session(ids, divisors), model(ids, divisors))
        edges = torch.tensor([0, -1, 1, -3, 3, 2**24 - 1, -(2**24) + 1, 7] * 8)
        ones = torch.ones(64, dtype=torch.int64)
        assert torch.equal(session(edges, ones), model(edges, ones))
        with pytest.raises(st.DaemonError, match="below 2\\^24"):
            session(torch.full((64,), 2**24 + 1), ones)
        with pytest.raises(st.DaemonError, match="ZeroDivisionError"):
            session(ids, torch.zeros(64, dtype=torch.int64))
        assert torch.equal(session(ids, divisors), model(ids, divisors))
