"""Torch workloads for benchmarking a cluster, public (the benchmarks and tests use them
too): a synthetic model of any parameter shapes (ResNet-50's are
`raytrain_x.common.workloads.resnet50_parameter_shapes()`), and networks whose backward
computes (ResNet-18, a GPT-style decoder) with deterministic synthetic data. Plain torch:
no torchvision, nothing downloaded."""

from __future__ import annotations

import torch

__all__ = ["GPTDecoder", "markov_tokens", "markov_entropy", "resnet18", "shaped_model",
           "synthetic_images", "synthetic_tokens"]


def shaped_model(shapes: list[tuple[int, ...]]):
    """A torch module whose parameters have `shapes` and whose backward produces every
    gradient in reverse registration order, as a real network's would; the gradient of
    parameter i is `scale * weight_i` (cheap, deterministic).

    Args:
        shapes: the parameters' shapes, in registration order (for example ResNet-50's,
            from `raytrain_x.common.workloads.resnet50_parameter_shapes()`).
    """
    class ShapedModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.weights = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(s, generator=g) * 0.01) for s in shapes)

        def forward(self, scale: torch.Tensor) -> torch.Tensor:
            total = scale.new_zeros(())
            for w in self.weights:  # a chain, so backward visits the last parameter first
                total = total + (w * w).sum() * scale
            return total * 0.5

    return ShapedModel()


# ----------------------------------------------------------------------------- networks
# Models whose backward computes (the benchmarks of docs/performance.md, issue 30): plain
# torch, no torchvision. Synthetic data is deterministic per (rank, step).

class _BasicBlock(torch.nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + (x if self.down is None else self.down(x)))


def resnet18(num_classes: int = 100) -> torch.nn.Module:
    """ResNet-18 (He et al.; torchvision's layout: 7x7 stride-2 stem, max pool, four stages
    of two basic blocks, 64-512 channels): 11.2M parameters, 62 tensors.

    Args:
        num_classes: the classifier's outputs.
    """
    nn = torch.nn
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                               nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for i, cout in enumerate((64, 128, 256, 512)):
        layers += [_BasicBlock(cin, cout, 1 if i == 0 else 2), _BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


class GPTDecoder(torch.nn.Module):
    """A GPT-style decoder language model: token and position embeddings, pre-norm causal
    self-attention blocks (GELU MLP of 4x width), a final norm and a head tied to the token
    embedding.

    Args:
        vocab: the vocabulary's size.
        layers: the decoder blocks.
        width: the model width.
        heads: attention heads per block.
        seq: the longest sequence (the position embedding's length).
    """

    def __init__(self, vocab: int = 8192, layers: int = 6, width: int = 512, heads: int = 8,
                 seq: int = 128) -> None:
        super().__init__()
        nn = torch.nn
        torch.manual_seed(0)
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(seq, width)
        # GPT-2's initialisation: with torch's N(0, 1) embeddings the tied head's logits
        # start in the hundreds, the loss far above chance, and the head's gradients in
        # subnormal floats, which made a CPU step 5x slower within a few steps
        for embedding in (self.tokens, self.positions):
            nn.init.normal_(embedding.weight, std=0.02)
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq),
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(n, device=ids.device))
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        return self.norm(x) @ self.tokens.weight.t()


def synthetic_images(batch: int, size: int = 64, classes: int = 100, seed: int = 0):
    """(images [batch, 3, size, size], labels [batch]), the same for the same seed.

    Args:
        batch: the batch size.
        size: the images' height and width.
        classes: labels are drawn from 0..classes-1.
        seed: the generator's seed.
    """
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, size, size, generator=g),
            torch.randint(0, classes, (batch,), generator=g))


def synthetic_tokens(batch: int, seq: int = 128, vocab: int = 8192, seed: int = 0):
    """(input ids [batch, seq], next-token targets [batch, seq]), the same for the seed.

    Args:
        batch: the batch size.
        seq: the sequence length.
        vocab: ids are drawn from 0..vocab-1.
        seed: the generator's seed.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


# A language a model can learn: each token is followed by one of a few tokens fixed for it,
# with fixed probabilities (a first-order Markov chain). Uniform random tokens
# (synthetic_tokens) time a step; this measures what a step learns.
MARKOV_PROBS = (0.5, 0.25, 0.15, 0.10)


def _markov_table(vocab: int, table_seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(table_seed)
    return torch.randint(0, vocab, (vocab, len(MARKOV_PROBS)), generator=g)


def markov_tokens(batch: int, seq: int = 128, vocab: int = 8192, seed: int = 0,
                  table_seed: int = 0):
    """(input ids [batch, seq], next-token targets [batch, seq]) from a first-order Markov
    chain: token t is followed by one of `len(MARKOV_PROBS)` successors fixed for t (drawn
    with `table_seed`), with probabilities `MARKOV_PROBS`. The same for the same seeds; a
    model that learns the chain reaches `markov_entropy()` nats of loss.

    Args:
        batch: the batch size.
        seq: the sequence length.
        vocab: ids are drawn from 0..vocab-1.
        seed: the generator's seed (the rows; a held-out set takes a seed no step uses).
        table_seed: the chain's (the same for every batch of one task).
    """
    table = _markov_table(vocab, table_seed)
    g = torch.Generator().manual_seed(seed)
    probs = torch.tensor(MARKOV_PROBS)
    ids = torch.empty(batch, seq + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    choices = torch.multinomial(probs, batch * seq, replacement=True, generator=g)
    choices = choices.view(batch, seq)
    for i in range(seq):
        ids[:, i + 1] = table[ids[:, i], choices[:, i]]
    return ids[:, :-1], ids[:, 1:]


def markov_entropy() -> float:
    """The loss (nats per token) of a model that knows `markov_tokens`' chain exactly (its
    successors are distinct: close to it otherwise)."""
    import math

    return -sum(p * math.log(p) for p in MARKOV_PROBS)

