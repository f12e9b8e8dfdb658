"""Draft trees for a tree verify (EAGLE-2, seed §2.3–§2.4): the layout the runner takes, and the
node selection of a dynamic tree.

A tree is given per request by ``parents``: its rows in topological order, row 0 the anchor
(parent −1), every other row's parent an earlier row. ``tree_layout`` turns a batch of them into
the runner's ``TreeLayout`` (depths and ancestor masks, padded to the longest tree).
"""

from __future__ import annotations

import torch

from specray.serving.runner import TreeLayout


def tree_layout(parents: list[list[int]]) -> TreeLayout:
    """Per request its rows' parents (row 0 the anchor, −1; ``parents[b][t] < t``) -> a
    ``TreeLayout`` over ``T = max(len)`` rows (a shorter tree's padding rows see only themselves,
    at depth 0). Example: ``[-1, 0, 0, 1]`` -> depths ``[0, 1, 1, 2]``, row 3 sees rows 0, 1, 3."""
    B, T = len(parents), max(len(p) for p in parents)
    depths = torch.zeros(B, T, dtype=torch.long)
    ancestors = torch.eye(T, dtype=torch.bool).repeat(B, 1, 1)  # [B, T, T]
    for b, tree in enumerate(parents):
        if tree[0] != -1 or any(not 0 <= p < t for t, p in enumerate(tree) if t):
            raise ValueError(f"request {b}'s tree {tree} is not topological (row 0 the root, parent -1, "
                             f"every other row's parent an earlier row)")
        for t, p in enumerate(tree[1:], start=1):
            depths[b, t] = depths[b, p] + 1
            ancestors[b, t] |= ancestors[b, p]
    return TreeLayout(depths, ancestors)
