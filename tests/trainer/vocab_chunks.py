"""A strategy's step with its vocabulary loss in one chunk and in many (``trainer/vocab_loss.py``)."""

import torch

from specray.trainer import vocab_loss


def assert_chunks_change_nothing(monkeypatch, strategy, model, cfg, batch, chunk_elements: int,
                                 **sums_tolerance) -> None:
    """Loss, metric sums and gradients of one step equal with ``VOCAB_CHUNK_ELEMENTS = chunk_elements``
    (several checkpointed chunks) and with the default (one chunk); ``sums_tolerance``: the metric
    sums' ``assert_close`` tolerances (default: its own)."""

    def run():
        model.zero_grad()
        loss, sums = strategy.forward_loss(model, cfg, batch, strategy.generator(0, 0))
        loss.backward()
        return loss.detach(), sums, [p.grad.clone() for p in model.parameters()]

    one = run()
    monkeypatch.setattr(vocab_loss, "VOCAB_CHUNK_ELEMENTS", chunk_elements)
    chunked = run()
    torch.testing.assert_close(chunked[0], one[0], rtol=1e-5, atol=1e-6)
    for name in one[1]:
        torch.testing.assert_close(chunked[1][name], one[1][name], **sums_tolerance)
    for a, b in zip(chunked[2], one[2]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
