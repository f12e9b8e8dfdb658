"""The accept step of chain workers: every request's drafts verified in one ``rejection_sample`` call.

A chain worker (DFlash; any worker that drafts ``[d1 .. dm]`` per request) has run the target on
``[a, d1 .. dm]`` for B requests at once. ``accept_chains`` checks each request's rows
(``check_finite``: a request whose logits are not finite fails alone), gives each the rows its
rule reads — greedy: the raw logits, sampled: ``p = process(logits)`` — and verifies the
healthy ones as one mixed batch in the ragged layout of ``kernels/rejection.py`` — each request
with its own number of drafts when the verify was ragged (DSpark's schedule).
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
                  draft_q: list[torch.Tensor | None], generators: list,
                  num_drafts: list[int] | None = None) -> Accepted:
    """Verify ``drafts`` [B, m] against the target's ``logits`` [B, m + 1, V] over ``[a, d1 .. dm]``.

    ``draft_q[b]`` is the [m, V] distribution (over the target's vocabulary) request b's drafts
    were sampled from, None for a greedy request; ``generators[b]`` draws its randoms.
    ``num_drafts[b]`` (None: m for every request) verifies only request b's first drafts, a
    ragged verify: its rows past ``num_drafts[b] + 1`` of ``logits`` and past ``num_drafts[b]``
    of ``drafts`` and ``draft_q[b]`` are padding and never read."""
    B, M, V = logits.shape
    n = [M - 1] * B if num_drafts is None else list(num_drafts)
    assert len(n) == B and all(0 <= x <= M - 1 for x in n), (n, M)
    errors: list[NonFiniteLogitsError | None] = [None] * B
    rows, keep = [], []
    for b, p in enumerate(params):
        try:
            rows.append(check_finite(logits[b, : n[b] + 1], p))  # [n_b + 1, V] logits (greedy) or p (sampled)
            keep.append(b)
        except NonFiniteLogitsError as e:
            errors[b] = e
    tokens, accepted = [[] for _ in range(B)], [0] * B
    if not keep:
        return Accepted(tokens, accepted, errors)
    device, sampled = logits.device, [not params[b].greedy for b in keep]
    full = num_drafts is None and len(keep) == B
    target = logits.reshape(B * M, V) if full and not any(sampled) else torch.cat(rows)  # no copy if greedy and full
    cu = torch.tensor([0] + [n[b] for b in keep], device=device).cumsum(0)  # [len(keep) + 1] draft offsets
    q = None
    if any(sampled):
        q = torch.cat([torch.zeros(n[b], V, device=device) if draft_q[b] is None else draft_q[b][: n[b]]
                       for b in keep])
    out, emitted = rejection_sample(
        target, torch.cat([drafts[b, : n[b]] for b in keep]).to(device), cu,
        torch.tensor(sampled, device=device).logical_not(), q,
        generators=[generators[b] if s else None for b, s in zip(keep, sampled)],
    )
    out, emitted, starts = out.tolist(), emitted.tolist(), cu.tolist()
    for i, b in enumerate(keep):  # request i's rows start at cu[i] + i (its drafts, then one more row)
        first = starts[i] + i
        tokens[b] = out[first : first + emitted[i]]
        accepted[b] = emitted[i] - 1
    return Accepted(tokens, accepted, errors)
