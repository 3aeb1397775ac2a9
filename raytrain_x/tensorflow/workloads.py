"""Keras workloads for benchmarking a cluster, public (the TensorFlow face's benchmarks use
them too): the same ResNet-18 and GPT-style decoder as `raytrain_x.torch.workloads` (layer
for layer, the same parameter counts), with deterministic synthetic data."""

from __future__ import annotations

import numpy as np

__all__ = ["gpt_decoder", "resnet18", "synthetic_images", "synthetic_tokens"]


def _keras():
    import keras

    return keras


def resnet18(num_classes: int = 100, size: int = 64):
    """ResNet-18 (torchvision's layout: 7x7 stride-2 stem, max pool, four stages of two
    basic blocks, 64-512 channels), channels last: 11.2M parameters, 62 trainable tensors
    (and the batch norms' moving statistics).

    Args:
        num_classes: the classifier's outputs.
        size: the input images' height and width.
    """
    keras = _keras()
    layers = keras.layers
    keras.utils.set_random_seed(0)

    def block(x, cout: int, stride: int):
        shortcut = x
        out = layers.Conv2D(cout, 3, stride, padding="same", use_bias=False)(x)
        out = layers.ReLU()(layers.BatchNormalization()(out))
        out = layers.Conv2D(cout, 3, 1, padding="same", use_bias=False)(out)
        out = layers.BatchNormalization()(out)
        if stride != 1 or x.shape[-1] != cout:
            shortcut = layers.Conv2D(cout, 1, stride, use_bias=False)(x)
            shortcut = layers.BatchNormalization()(shortcut)
        return layers.ReLU()(out + shortcut)

    inputs = keras.Input((size, size, 3))
    x = layers.Conv2D(64, 7, 2, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    x = layers.MaxPooling2D(3, 2, padding="same")(x)
    for i, cout in enumerate((64, 128, 256, 512)):
        x = block(x, cout, 1 if i == 0 else 2)
        x = block(x, cout, 1)
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, layers.Dense(num_classes)(x), name="resnet18")


def gpt_decoder(vocab: int = 8192, layers_: int = 6, width: int = 512, heads: int = 8,
                seq: int = 128):
    """A GPT-style decoder language model: token and position embeddings, pre-norm causal
    self-attention blocks (GELU MLP of 4x width), a final norm and a head tied to the token
    embedding.

    Args:
        vocab: the vocabulary's size.
        layers_: the decoder blocks.
        width: the model width.
        heads: attention heads per block.
        seq: the sequence length.
    """
    keras = _keras()
    layers = keras.layers
    ops = keras.ops
    keras.utils.set_random_seed(0)

    class TiedHead(layers.Layer):
        def __init__(self, embedding, **kwargs):
            super().__init__(**kwargs)
            self.embedding = embedding

        def call(self, x):
            return ops.matmul(x, ops.transpose(self.embedding.embeddings))

    ids = keras.Input((seq,), dtype="int32")
    tokens = layers.Embedding(vocab, width)
    positions = layers.Embedding(seq, width)
    x = tokens(ids) + positions(ops.arange(seq))
    for _ in range(layers_):
        h = layers.LayerNormalization(epsilon=1e-5)(x)
        h = layers.MultiHeadAttention(heads, width // heads)(h, h, use_causal_mask=True)
        x = x + h
        h = layers.LayerNormalization(epsilon=1e-5)(x)
        h = layers.Dense(4 * width, activation="gelu")(h)
        x = x + layers.Dense(width)(h)
    x = layers.LayerNormalization(epsilon=1e-5)(x)
    return keras.Model(ids, TiedHead(tokens)(x), name="gpt_decoder")


def synthetic_images(batch: int, size: int = 64, classes: int = 100, seed: int = 0):
    """(images [batch, size, size, 3] float32, labels [batch] int32), the same per seed.

    Args:
        batch: the batch size.
        size: the images' height and width.
        classes: labels are drawn from 0..classes-1.
        seed: the generator's seed.
    """
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, size, size, 3), dtype=np.float32),
            rng.integers(0, classes, batch, dtype=np.int32))


def synthetic_tokens(batch: int, seq: int = 128, vocab: int = 8192, seed: int = 0):
    """(input ids [batch, seq], next-token targets [batch, seq]) int32, the same per seed.

    Args:
        batch: the batch size.
        seq: the sequence length.
        vocab: ids are drawn from 0..vocab-1.
        seed: the generator's seed.
    """
    ids = np.random.default_rng(seed).integers(0, vocab, (batch, seq + 1), dtype=np.int32)
    return ids[:, :-1], ids[:, 1:]
