"""Draft trees for a tree verify (EAGLE-2, seed §2.3–§2.4): the layout the runner takes, the
node selection of a dynamic tree, and the accept step along the tree.

A tree is given per request by ``parents``: its rows in topological order, row 0 the anchor
(parent −1), every other row's parent an earlier row. ``tree_layout`` turns a batch of them into
the runner's ``TreeLayout`` (depths and ancestor masks, padded to the longest tree);
``select_tree`` keeps the best ``size`` generated nodes (the rerank); ``accept_tree`` walks the
tree from the anchor (greedy: the argmax path; sampled: multi-draft recursive rejection).
The worker is ``serving/workers/eagle3_tree.py``; tests: ``pytest tests/serving/test_tree.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specray.serving.runner import TreeLayout
from specray.serving.sampling import NonFiniteLogitsError, SamplingParams, check_finite


def tree_layout(parents: list[list[int]]) -> TreeLayout:
    """Per request its rows' parents (row 0 the anchor, −1; ``parents[b][t] < t``) -> a
    ``TreeLayout`` over ``T = max(len)`` rows (a shorter tree's padding rows see only themselves,
    at depth 0). Example: ``[-1, 0, 0, 1]`` -> depths ``[0, 1, 1, 2]``, row 3 sees rows 0, 1, 3."""
    B, T = len(parents), max(len(p) for p in parents)
    depths = torch.zeros(B, T, dtype=torch.long, device="cpu")  # the runner's layout: CPU, like its bookkeeping
    ancestors = torch.eye(T, dtype=torch.bool, device="cpu").repeat(B, 1, 1)  # [B, T, T]
    for b, tree in enumerate(parents):
        if tree[0] != -1 or any(not 0 <= p < t for t, p in enumerate(tree) if t):
            raise ValueError(f"request {b}'s tree {tree} is not topological (row 0 the root, parent -1, "
                             f"every other row's parent an earlier row)")
        for t, p in enumerate(tree[1:], start=1):
            depths[b, t] = depths[b, p] + 1
            ancestors[b, t] |= ancestors[b, p]
    return TreeLayout(depths, ancestors)


@dataclass
class DraftTree:
    """The rows one tree verify runs per request: row 0 the anchor, rows ``1 … size`` the kept
    draft nodes in generation order (a parent before its children)."""

    tokens: torch.Tensor  # [B, 1 + size] target ids, column 0 the anchors
    parents: list[list[int]]  # [B][1 + size] each row's parent row (−1 for the anchor)


def select_tree(anchors: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor,
                size: int) -> DraftTree:
    """EAGLE-2's rerank (seed §2.3): of the ``N`` generated nodes per request keep the ``size``
    with the highest cumulative draft log-probability.

    anchors [B]; tokens / parents / scores [B, N] in generation order (depth by depth; a node's
    parent, −1 for the anchor's children, is an earlier node). Ties go to the earlier node (a
    stable sort), and a child's score is its parent's plus a log-probability (<= 0, and float
    addition of a non-positive number never increases), so the kept set holds every kept node's
    parent: the ancestor closure. Example, scores ``[-0.1, -1.0, -0.5, -2.0]`` with parents
    ``[-1, -1, 0, 2]`` and size 2 keep nodes 0 and 2 (rows 1, 2 with parents ``[-1, 0, 1]``)."""
    B, N = scores.shape
    if not 1 <= size <= N:
        raise ValueError(f"a tree of {size} nodes from {N} generated ones: size must be in [1, {N}]")
    keep = torch.sort(-scores, dim=1, stable=True).indices[:, :size].sort(dim=1).values  # [B, size] generation order
    row_of = torch.full((B, N), -1, dtype=torch.long, device=keep.device).scatter_(
        1, keep, torch.arange(1, size + 1, device=keep.device).expand(B, size))
    parent_node = parents.gather(1, keep)  # [B, size]
    parent_row = torch.where(parent_node < 0, 0, row_of.gather(1, parent_node.clamp(min=0)))
    assert bool((parent_row >= 0).all()), "the kept nodes are not closed under ancestors"
    ids = torch.cat([anchors[:, None], tokens.gather(1, keep)], dim=1)
    return DraftTree(ids, [[-1] + row for row in parent_row.tolist()])


def accept_tree(target: torch.Tensor, tokens: list[int], parents: list[int], greedy: bool,
                draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None
                ) -> tuple[list[int], list[int]]:
    """Verify one request's tree: ``(path, emitted)``, the accepted rows ``[0, t1 … tr]`` and the
    tokens ``[x_t1 … x_tr, x*]``.

    target [T, V]: the target's logits at each row (greedy: only their argmax is read) or its
    probabilities ``p`` (sampled); tokens / parents [T] the rows' tokens and parent rows.

    - Greedy: from the anchor, follow the child whose token is the row's argmax (siblings hold
      distinct tokens); ``x*`` is the argmax at the last accepted row.
    - Sampled, multi-draft recursive rejection (SpecInfer; seed §1.2 applied per sibling): at
      row ``n`` with ``p = p_n``, try its children ``c`` in row order: accept ``c`` iff
      ``u * q_c(x_c) < p(x_c)`` (probability ``min(1, p/q)``), else ``p <- norm([p − q_c]+)`` and
      try the next sibling against that residual; with no child accepted ``x*`` is drawn from
      the last ``p`` (the correction, or the bonus at a leaf). ``q_c`` (``draft_probs[c]``) is the
      distribution ``x_c`` was drawn from given its parent and its earlier siblings: drawn
      without replacement, ``q_c`` is the parent's draft distribution with the earlier
      siblings' tokens removed and renormalised. ``draft_probs=None`` means deterministic
      candidates (the worker's top-k children), ``q_c = δ(x_c)``: accept with probability
      ``p(x_c)``, else remove ``x_c`` from ``p``.

    Lossless: one sibling step gives ``x`` mass ``min(p, q_c)(x)`` on accept and spreads the
    reject probability ``Σ[p − q_c]+`` as the residual, summing to ``p`` (seed §1.2); given a
    rejection the later siblings' draws are distributed as their ``q``, so by induction the node's
    outcome is distributed as ``p_n``, and each accepted child starts the same at its own row.
    A ``q`` other than the drawing distribution breaks this (``tests/serving/test_tree.py``)."""
    children: list[list[int]] = [[] for _ in tokens]
    for t, parent in enumerate(parents[1:], start=1):
        children[parent].append(t)
    node, path = 0, [0]
    while True:
        p = target[node]  # [V]
        if greedy:
            best = int(p.argmax())
            nxt = next((c for c in children[node] if tokens[c] == best), None)
        else:
            nxt, p = _try_children(p, children[node], tokens, draft_probs, generator)
        if nxt is None:
            x = best if greedy else int(torch.multinomial(p, 1, generator=generator))
            return path, [tokens[t] for t in path[1:]] + [x]
        path.append(nxt)
        node = nxt


def _try_children(p: torch.Tensor, children: list[int], tokens: list[int], draft_probs: torch.Tensor | None,
                  generator: torch.Generator | None) -> tuple[int | None, torch.Tensor]:
    """The sibling loop of ``accept_tree`` (sampled): (the accepted child or None, the residual p)."""
    for c in children:
        x = tokens[c]
        q_x = 1.0 if draft_probs is None else float(draft_probs[c, x])
        if float(torch.rand((), generator=generator, device=p.device)) * q_x < float(p[x]):
            return c, p
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[c]).clamp_min(0.0)
        total = residual.sum()
        if total > 0:  # an all-zero residual (only through rounding) keeps p
            p = residual / total
    return None, p


@dataclass
class TreeAccepted:
    paths: list[list[int]]  # [B][r_b + 1] accepted rows [0, t1 … tr] ([] when it failed)
    tokens: list[list[int]]  # [B][r_b + 1] emitted [x_t1 … x_tr, x*] ([] when it failed)
    errors: list[NonFiniteLogitsError | None]  # [B]


def accept_trees(logits: torch.Tensor, trees: DraftTree, params: list[SamplingParams], generators: list
                 ) -> TreeAccepted:
    """``accept_tree`` for every request of a tree verify (logits [B, T, V]), the draft nodes
    being deterministic candidates; a request whose logits are not finite fails alone."""
    B = logits.shape[0]
    accepted = TreeAccepted([[] for _ in range(B)], [[] for _ in range(B)], [None] * B)
    for b, (p, generator) in enumerate(zip(params, generators)):
        try:
            rows = check_finite(logits[b], p)  # [T, V] logits (greedy) or p (sampled)
        except NonFiniteLogitsError as e:
            accepted.errors[b] = e
            continue
        accepted.paths[b], accepted.tokens[b] = accept_tree(rows, trees.tokens[b].tolist(), trees.parents[b],
                                                            p.greedy, None, generator)
    return accepted
