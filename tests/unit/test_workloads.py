"""The networks the benchmarks train (raytrain_x.torch.workloads): their size, that their
synthetic data is deterministic, and that a step trains."""

from __future__ import annotations

import torch

from raytrain_x.torch.workloads import GPTDecoder, resnet18, synthetic_images, synthetic_tokens


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
