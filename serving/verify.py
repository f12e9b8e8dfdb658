"""The accept step of chain workers: every request's drafts verified in one ``rejection_sample`` call.

A chain worker (DFlash; any worker that drafts ``[d1 .. dm]`` per request) has run the target on
``[a, d1 .. dm]`` for B requests at once. ``accept_chains`` checks each request's rows
(``check_finite``: a request whose logits are not finite fails alone), gives each the rows its
rule reads — greedy: the raw logits, sampled: ``p = process(logits)`` — and verifies the
healthy ones as one mixed batch in the ragged layout of ``kernels/rejection.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specray.kernels.rejection import rejection_sample
from specray.serving.sampling import NonFiniteLogitsError, SamplingParams, check_finite


@dataclass
class Accepted:
    tokens: list[list[int]]  # [B][r_b + 1] emitted per request: [d1 .. dr, x*] ([] when it failed)
    accepted: list[int]  # [B] r_b, drafts accepted (0 when it failed)
    errors: list[NonFiniteLogitsError | None]  # [B]


def accept_chains(logits: torch.Tensor, drafts: torch.Tensor, params: list[SamplingParams],
                  draft_q: list[torch.Tensor | None], generators: list) -> Accepted:
    """Verify ``drafts`` [B, m] against the target's ``logits`` [B, m + 1, V] over ``[a, d1 .. dm]``.

    ``draft_q[b]`` is the [m, V] distribution (over the target's vocabulary) request b's drafts
    were sampled from, None for a greedy request; ``generators[b]`` draws its randoms."""
    B, M, V = logits.shape
    errors: list[NonFiniteLogitsError | None] = [None] * B
    rows, keep = [], []
    for b, p in enumerate(params):
        try:
            rows.append(check_finite(logits[b], p))  # [M, V] logits (greedy) or p (sampled)
            keep.append(b)
        except NonFiniteLogitsError as e:
            errors[b] = e
    tokens, accepted = [[] for _ in range(B)], [0] * B
    if not keep:
        return Accepted(tokens, accepted, errors)
    device, sampled = logits.device, [not params[b].greedy for b in keep]
    all_greedy_kept = len(keep) == B and not any(sampled)
    target = logits.reshape(B * M, V) if all_greedy_kept else torch.cat(rows)  # [len(keep) * M, V], no copy if greedy
    q = None
    if any(sampled):
        q = torch.cat([torch.zeros(M - 1, V, device=device) if draft_q[b] is None else draft_q[b] for b in keep])
    out, emitted = rejection_sample(
        target, drafts[keep].reshape(-1).to(device), torch.arange(len(keep) + 1, device=device) * (M - 1),
        torch.tensor(sampled, device=device).logical_not(), q,
        generators=[generators[b] if s else None for b, s in zip(keep, sampled)],
    )
    out, emitted = out.tolist(), emitted.tolist()
    for i, b in enumerate(keep):  # request i's rows start at i * M (every request verifies m drafts)
        tokens[b] = out[i * M : i * M + emitted[i]]
        accepted[b] = emitted[i] - 1
    return Accepted(tokens, accepted, errors)
