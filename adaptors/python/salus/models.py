"""The target models of the adaptor, at small configurable sizes, and their batches.

Four models exercise the tracer and the IR's op set end to end:

- ``mlp``: a multilayer perceptron (linear, ReLU, optional dropout);
- ``cnn``: a small CNN with convolution, batch norm, ReLU, max pooling, a residual block
  and adaptive average pooling;
- ``gpt``: a GPT-style decoder (token and position embeddings, layer norm, causal
  self-attention through ``scaled_dot_product_attention``, GELU MLP), trained with
  cross-entropy over the next tokens;
- ``resnet18``: torchvision's resnet18 (10 classes). ``width`` below 64 builds the same
  topology from torchvision's ``BasicBlock`` with narrower layers (for small reference
  files); 64 is torchvision's model itself.

:func:`large_models` adds the models of the profiling targets at their real sizes
(torchvision's resnet50 and vit_b_16 at 224 px, a stock ``nn.TransformerEncoder``, the
GPT-style decoder at sequence 512 and width 768), every size a parameter so that tests
can build them small.

Every model is built from a seed and every batch is drawn from a seeded generator, so
the same arguments give the same tensors; the global RNG is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, in_features: int = 32, hidden: tuple[int, ...] = (64, 64),
                 num_classes: int = 10, dropout: float = 0.0):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(dropout)]
            width = h
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout))


class ResidualBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = _conv_bn(channels, channels)
        self.conv2 = _conv_bn(channels, channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.conv1(x))
        return self.relu(self.conv2(y) + x)


class SmallCNN(nn.Module):
    def __init__(self, in_channels: int = 3, width: int = 8, num_classes: int = 10):
        super().__init__()
        self.stem = _conv_bn(in_channels, width)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2)
        self.block = ResidualBlock(width)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.stem(x)))
        x = self.block(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class DecoderBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-style decoder: ``forward(tokens[B, T]) -> logits[B, T, vocab]``."""

    def __init__(self, vocab_size: int = 64, block_size: int = 16, n_layer: int = 2,
                 n_head: int = 2, n_embd: int = 32, dropout: float = 0.0):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[DecoderBlock(n_embd, n_head, dropout)
                                      for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        return self.head(self.ln_f(self.blocks(x)))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``logits[B, T, V]`` against the next tokens ``targets[B, T]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def resnet18(num_classes: int = 10, width: int = 64) -> nn.Module:
    """torchvision's resnet18; ``width < 64`` narrows every layer by ``width / 64``."""
    import torchvision
    from torchvision.models.resnet import BasicBlock, ResNet

    if width == 64:
        return torchvision.models.resnet18(num_classes=num_classes)
    model = ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
    return _narrow_resnet(model, width, num_classes)


def _narrow_resnet(model: nn.Module, width: int, num_classes: int) -> nn.Module:
    """Rebuilds a torchvision ResNet's stem, layers and head at base width ``width``."""
    from torchvision.models.resnet import BasicBlock

    model.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
    model.bn1 = nn.BatchNorm2d(width)
    model.inplanes = width
    for index, (mult, stride) in enumerate(((1, 1), (2, 2), (4, 2), (8, 2)), start=1):
        setattr(model, f"layer{index}", model._make_layer(BasicBlock, width * mult, 2,
                                                          stride=stride))
    model.fc = nn.Linear(width * 8, num_classes)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    return model


class Encoder(nn.Module):
    """A stock ``nn.TransformerEncoder`` (post-norm layers, ReLU, dropout 0.1, batch
    first): ``forward(x[B, T, d]) -> y[B, T, d]``."""

    def __init__(self, d_model: int = 512, n_head: int = 8, n_layer: int = 6,
                 dim_feedforward: int = 2048, dropout: float = 0.1):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, n_head, dim_feedforward, dropout,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)


# ---------------------------------------------------------------------------------------
# Batches


def image_batch(batch_size: int, size: int, num_classes: int = 10, channels: int = 3,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, channels, size, size, generator=g)
    y = torch.randint(0, num_classes, (batch_size,), generator=g)
    return x, y


def vector_batch(batch_size: int, features: int, num_classes: int = 10,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, features, generator=g)
    y = torch.randint(0, num_classes, (batch_size,), generator=g)
    return x, y


def sequence_batch(batch_size: int, length: int, width: int,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, target)``: two random ``[batch, length, width]`` tensors (a regression)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, length, width, generator=g)
    return x, torch.randn(batch_size, length, width, generator=g)


def token_batch(batch_size: int, block_size: int, vocab_size: int,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, next tokens)``: a random sequence and the same shifted by one."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab_size, (batch_size, block_size + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


# ---------------------------------------------------------------------------------------
# The registry


@dataclass(frozen=True)
class TargetModel:
    """A target model at one size: how to build it, its loss and its batches."""

    name: str
    build: Callable[[], nn.Module]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch: Callable[[int], tuple[torch.Tensor, ...]]  # seed -> (inputs..., target)

    def model(self, seed: int = 0) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.build()


def target_models(batch_size: int = 8, image_size: int = 32, resnet_size: int = 64,
                  resnet_width: int = 64) -> dict[str, TargetModel]:
    """The four target models at small sizes (defaults keep tests fast)."""
    vocab, block = 64, 16
    return {
        "mlp": TargetModel("mlp", lambda: MLP(32, (64, 64), 10), F.cross_entropy,
                           lambda seed: vector_batch(batch_size, 32, 10, seed)),
        "cnn": TargetModel("cnn", lambda: SmallCNN(3, 8, 10), F.cross_entropy,
                           lambda seed: image_batch(batch_size, image_size, 10, seed=seed)),
        "gpt": TargetModel("gpt", lambda: TinyGPT(vocab, block, 2, 2, 32), next_token_loss,
                           lambda seed: token_batch(batch_size, block, vocab, seed)),
        "resnet18": TargetModel("resnet18", lambda: resnet18(10, resnet_width),
                                F.cross_entropy,
                                lambda seed: image_batch(batch_size, resnet_size, 10,
                                                         seed=seed)),
    }


def large_models(batch_size: int = 32, image_size: int = 224, num_classes: int = 1000,
                 seq: int = 128, d_model: int = 512, layers: int = 6,
                 gpt_seq: int = 512, gpt_width: int = 768, gpt_heads: int = 12,
                 gpt_layers: int = 6, gpt_vocab: int = 8192) -> dict[str, TargetModel]:
    """The profiling targets at their real sizes (defaults):

    - ``resnet50``: torchvision's, ``image_size`` px, ``num_classes`` classes;
    - ``vit_b_16``: torchvision's, built for ``image_size`` px (16 px patches);
    - ``transformer``: :class:`Encoder`, ``layers`` layers of width ``d_model`` (8 heads,
      feed-forward 4x), sequence ``seq``, trained on MSE against a random target;
      ``transformer_nodrop`` the same without dropout (attention then runs as the flash
      op, with dropout as the efficient op: :mod:`salus.attention`);
    - ``gpt512``: :class:`TinyGPT` at sequence ``gpt_seq`` and width ``gpt_width``
      (``gpt_heads`` heads, ``gpt_layers`` layers, vocabulary ``gpt_vocab``).
    """

    def tv(name: str, **kwargs) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            import torchvision

            return getattr(torchvision.models, name)(num_classes=num_classes, **kwargs)

        return build

    def images(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return image_batch(batch_size, image_size, num_classes, seed=seed)

    return {
        "resnet50": TargetModel("resnet50", tv("resnet50"), F.cross_entropy, images),
        "vit_b_16": TargetModel("vit_b_16", tv("vit_b_16", image_size=image_size),
                                F.cross_entropy, images),
        "transformer": TargetModel(
            "transformer", lambda: Encoder(d_model, 8, layers, 4 * d_model), F.mse_loss,
            lambda seed: sequence_batch(batch_size, seq, d_model, seed)),
        "transformer_nodrop": TargetModel(
            "transformer_nodrop", lambda: Encoder(d_model, 8, layers, 4 * d_model, 0.0),
            F.mse_loss, lambda seed: sequence_batch(batch_size, seq, d_model, seed)),
        "gpt512": TargetModel(
            "gpt512", lambda: TinyGPT(gpt_vocab, gpt_seq, gpt_layers, gpt_heads, gpt_width),
            next_token_loss, lambda seed: token_batch(batch_size, gpt_seq, gpt_vocab, seed)),
    }
