"""The networks the benchmarks train (raytrain_x.torch.workloads): their size, that their
synthetic data is deterministic, and that a step trains."""

from __future__ import annotations

import math

import torch

from raytrain_x.torch.workloads import (
    GPTDecoder,
    markov_entropy,
    markov_tokens,
    resnet18,
    synthetic_images,
    synthetic_tokens,
)


def test_resnet18_has_resnet18s_parameters_and_trains_on_synthetic_images():
    torch.set_num_threads(1)
    model = resnet18()
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == 11_227_812 and len(params) == 62
    x, y = synthetic_images(4, seed=3)
    again, _ = synthetic_images(4, seed=3)
    assert torch.equal(x, again) and x.shape == (4, 3, 64, 64)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    assert all(p.grad is not None for p in params)


def test_the_gpt_decoder_is_causal_and_trains_on_synthetic_tokens():
    torch.set_num_threads(1)
    model = GPTDecoder(vocab=64, layers=2, width=32, heads=4, seq=16)
    ids, targets = synthetic_tokens(2, seq=16, vocab=64, seed=1)
    assert torch.equal(ids[:, 1:], targets[:, :-1])  # next-token targets
    logits = model(ids)
    assert logits.shape == (2, 16, 64)
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 64  # the last token cannot change earlier outputs
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    assert model.tokens.weight.grad is not None
    assert sum(p.numel() for p in GPTDecoder().parameters()) == 23_175_168


def test_the_gpt_decoder_starts_near_chance():
    """GPT-2's initialisation: the first loss is about ln(vocab), not hundreds (whose
    gradients fall into subnormal floats, 5x slower on a CPU within a few steps)."""
    torch.set_num_threads(1)
    ids, targets = synthetic_tokens(2, seed=0)
    with torch.no_grad():
        logits = GPTDecoder(layers=1)(ids)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert abs(float(loss) - math.log(8192)) < 1.0, float(loss)


def test_markov_tokens_follow_their_chain_and_a_model_learns_it():
    torch.set_num_threads(1)
    ids, targets = markov_tokens(8, seq=32, vocab=64, seed=1)
    assert torch.equal(ids[:, 1:], targets[:, :-1])
    assert torch.equal(markov_tokens(8, seq=32, vocab=64, seed=1)[0], ids)
    assert not torch.equal(markov_tokens(8, seq=32, vocab=64, seed=2)[0], ids)
    pairs = {(int(a), int(b)) for a, b in zip(ids.flatten(), targets.flatten())}
    successors: dict[int, set[int]] = {}
    for a, b in pairs:
        successors.setdefault(a, set()).add(b)
    assert max(len(s) for s in successors.values()) <= 4  # each token's few successors
    model = GPTDecoder(vocab=64, layers=1, width=32, heads=4, seq=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(100):
        x, y = markov_tokens(16, seq=32, vocab=64, seed=step)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > math.log(64) - 0.5
    assert losses[-1] < markov_entropy() + 0.6, losses[-1]


def test_the_keras_twins_match_the_torch_networks():
    pytest = __import__("pytest")
    pytest.importorskip("tensorflow")
    from raytrain_x.tensorflow import workloads as kw

    resnet = kw.resnet18()
    assert len(resnet.trainable_weights) == 62
    assert sum(int(w.numpy().size) for w in resnet.trainable_weights) == 11_227_812
    x, y = kw.synthetic_images(2, seed=3)
    assert (x == kw.synthetic_images(2, seed=3)[0]).all() and x.shape == (2, 64, 64, 3)
    assert resnet(x).shape == (2, 100)
    gpt = kw.gpt_decoder(vocab=64, layers_=2, width=32, heads=4, seq=16)
    ids, targets = kw.synthetic_tokens(2, seq=16, vocab=64, seed=1)
    assert (ids[:, 1:] == targets[:, :-1]).all()
    logits = gpt(ids).numpy()
    changed = ids.copy()
    changed[:, -1] = (changed[:, -1] + 1) % 64  # the last token cannot change earlier outputs
    assert abs(gpt(changed).numpy()[:, :-1] - logits[:, :-1]).max() < 1e-5
