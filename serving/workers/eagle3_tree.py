"""EAGLE-3 with EAGLE-2 dynamic draft trees (seed §2.3–§2.4): the drafter grows a tree from its
state, the best ``size`` nodes are verified in one target forward under a tree mask, the
longest accepted path is committed.

A round for a request whose target cache holds ``n`` rows, anchor ``a`` (no KV yet), drafter state
``s`` (as in ``serving/workers/eagle3.py``), node budget ``size``, ``w = min(top_k, size)``,
depth cap ``d = min(depth, size)``:

    expand   depth 1: the w most likely tokens under head(s); each depth e < d: the w best
             depth-e nodes (the frontier) each run one drafter row (parent's output state, its
             token) at position n + e, scratch at drafter rows n + (e−1)·w + j under a tree mask
             (committed rows, its ancestors' rows, itself); each yields its w most likely children
    rerank   every generated node by cumulative draft log-probability, keep the best ``size``
             (ancestor-closed, ties to the earlier node: ``serving/tree.py::select_tree``)
    verify   target forward on [a, kept nodes] with depth positions and the ancestor mask
    accept   the longest argmax path (greedy) or recursive rejection along the tree (sampled;
             the nodes are deterministic candidates, q = δ: ``serving/tree.py::accept_tree``)
    commit   target rows of [a, path] compacted to n … n + r, committed (r + 1 rows)
    extend   drafter rows (g of the path's target rows) with (path tokens, x*), as the chain does

Nodes deeper than ``size`` or beyond the ``size`` best of a depth can never be kept, hence
``w`` and ``d`` shrink with the budget (the kept tree is the same). The drafter's tree rows are
scratch: the extend recomputes the committed rows from target-confirmed features, so after a
round the caches equal a fresh prefill of the accepted text (tested), as for the chain.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from specray.drafters.eagle3 import Eagle3Drafter
from specray.serving.kv_cache import tree_attention_mask
from specray.serving.runner import LlamaRunner, pad_rows
from specray.serving.sampling import process
from specray.serving.tree import accept_trees, select_tree, tree_layout
from specray.serving.workers.base import StepOutput
from specray.serving.workers.eagle3 import Eagle3Worker

DEFAULT_DEPTH = 6  # the longest path a tree may hold
DEFAULT_TOP_K = 4  # children per expanded node, and the frontier's width
DEFAULT_MAX_NODES = 16  # num_speculative_tokens: the largest node budget (rows beyond the anchor); CPU-sized
NODE_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the sizes offered, up to the largest


class Eagle3TreeWorker(Eagle3Worker):
    """EAGLE-3 drafter, EAGLE-2 trees. ``num_speculative_tokens`` = the largest node budget, the
    drafts one round verifies as for a chain (default 16; vLLM and SGLang count tree nodes the
    same way), ``depth`` = the depth cap (default 6), ``top_k`` = children per expanded node and
    frontier width (default 4). ``verify_sizes`` = the ``NODE_BUDGETS`` up to the largest (and
    the largest itself), no more than a full-width tree holds; ``step(..., size)`` verifies a
    tree of ``size`` nodes beyond the anchor (0: a plain step)."""

    verify_layout = "tree"

    def __init__(self, runner: LlamaRunner, drafter: Eagle3Drafter, *, num_speculative_tokens: int | None = None,
                 top_k: int | None = None, depth: int | None = None):
        max_nodes = DEFAULT_MAX_NODES if num_speculative_tokens is None else num_speculative_tokens
        depth = DEFAULT_DEPTH if depth is None else depth
        top_k = DEFAULT_TOP_K if top_k is None else top_k
        draft_vocab = drafter.config.draft_vocab_size or drafter.config.vocab_size
        if not 1 <= top_k <= draft_vocab:
            raise ValueError(f"top_k must be in [1, {draft_vocab}] (the drafter's vocabulary), got {top_k}")
        if max_nodes < 1 or depth < 1:
            raise ValueError(f"num_speculative_tokens (the largest node budget) and depth must be >= 1, got "
                             f"{max_nodes} and {depth}")
        depth = min(depth, max_nodes)  # a path of more nodes than the budget never fits
        # the depth cap (the engine's chooser reads it) and the width, before the base class sizes its cache
        self.max_depth, self.top_k = depth, top_k
        super().__init__(runner, drafter, num_speculative_tokens=depth)
        cap = min(max_nodes, top_k + (depth - 1) * top_k**2)  # a full-width tree's nodes
        self.verify_sizes = tuple(sorted({s for s in NODE_BUDGETS if s <= cap} | {cap}))

    def _scratch_rows(self) -> int:
        """Drafter-cache rows past the target's ``max_len``: the tree's scratch rows (``depth − 1``
        frontiers of ``top_k`` rows) may outnumber the target's verify rows."""
        return (self.max_depth - 1) * self.top_k

    @torch.inference_mode()
    def draft_tree(self, slots: list[int], params, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expand the tree for a budget of ``size`` (module docstring); returns every generated
        node's (target token, parent node or −1, cumulative draft log-probability), each [B, N],
        in generation order: depth by depth, a depth's nodes by frontier row then child rank."""
        w, depth, device = min(self.top_k, size), min(self.max_depth, size), self.device
        slot_t = torch.tensor(slots, device="cpu")
        committed = self.cache.committed[slot_t]  # [B] (CPU)
        B, D = len(slots), self.state.shape[-1]
        state = self.state[slot_t.to(device)]  # [B, D]
        scores, tokens = self._children(self.drafter.compute_logits(state)[:, None], params, w)
        nodes = [(tokens.view(B, w), torch.full((B, w), -1, device=device), scores.view(B, w))]  # per depth: [B, n_e] each
        first, pick = 0, torch.arange(w, device=device).expand(B, w)  # the last depth's first node; the frontier in it [B, w]
        state = state[:, None].expand(B, w, D)  # [B, w, D] the frontier's parents' output states
        ancestors = torch.zeros(B, w, 0, dtype=torch.bool, device=device)  # [B, w, S]: scratch rows of each frontier node's ancestors
        for e in range(1, depth):  # the depth-e frontier runs its drafter rows; its children are at depth e + 1
            S = (e - 1) * w
            mask = torch.cat([tree_attention_mask(committed, ancestors, int(committed.max()) + S),
                              torch.eye(w, dtype=torch.bool, device=device).expand(B, w, w)], dim=-1)  # [B, w, C + w]
            last_tokens, _, last_scores = nodes[-1]
            out = self._run_rows(slot_t, committed + S, state, last_tokens.gather(1, pick),
                                 (committed.to(device) + e)[:, None].expand(B, w), mask)  # [B, w, D]
            scores, tokens = self._children(self.drafter.compute_logits(out), params, w)  # [B, w, w]
            scores = last_scores.gather(1, pick)[:, :, None] + scores
            parents = (first + pick)[:, :, None].expand(B, w, w)
            first += last_tokens.shape[1]
            nodes.append((tokens.reshape(B, w * w), parents.reshape(B, w * w), scores.reshape(B, w * w)))
            pick = torch.sort(-nodes[-1][2], dim=1, stable=True).indices[:, :w]  # the next frontier: the w best
            row = pick // w  # [B, w] the frontier row (of this forward) of each new frontier node's parent
            state = out.gather(1, row[..., None].expand(B, w, D))
            ancestors = torch.cat([ancestors.gather(1, row[..., None].expand(B, w, S)), F.one_hot(row, w).bool()], -1)
        return tuple(torch.cat(column, dim=1) for column in zip(*nodes))

    def _children(self, logits: torch.Tensor, params, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits [B, m, V_d] -> the w most likely next tokens of each row: (log-probabilities
        [B, m, w] under the request's sampling params (plain softmax when greedy), target ids [B, m, w])."""
        logq = torch.stack([logits[b].float().log_softmax(-1) if p.greedy else process(logits[b], p).log()
                            for b, p in enumerate(params)])
        values, index = logq.topk(w, dim=-1)
        return values, self.drafter.draft_to_target(index)

    def step(self, slots: list[int], anchors: list[int], params, generators, size: int) -> StepOutput:
        """One expand → rerank → verify → accept → commit → extend round with a budget of ``size``
        nodes per request (in ``verify_sizes``; 0: a plain step)."""
        owed = self._take_anchors(slots, anchors)
        if size == 0:
            return self._plain_step(slots, anchors, params, generators, owed)
        if size not in self.verify_sizes:
            raise ValueError(f"size {size} is not a node budget of this worker {self.verify_sizes} (or 0: a plain step)")
        owed += self.catch_up(slots)
        t0 = time.perf_counter()
        tree = select_tree(torch.tensor(anchors, device=self.device), *self.draft_tree(slots, params, size), size)
        layout = tree_layout(tree.parents)
        B, T = tree.tokens.shape
        t1 = time.perf_counter()
        out = self.runner.forward(tree.tokens, torch.tensor(slots, device="cpu"), torch.full((B,), T, device="cpu"),
                                  tree=layout)
        t2 = time.perf_counter()
        result = accept_trees(out.logits, tree, params, generators)
        t3 = time.perf_counter()
        for slot, path in zip(slots, result.paths):
            if path:
                self.runner.cache.compact(slot, torch.tensor(path, device="cpu"))
                self.runner.cache.commit(slot, len(path))
        index, _ = pad_rows([path or [0] for path in result.paths])  # [B, r_max + 1] the path's verify rows
        features = self._features(out)  # [B, T, L·D]
        index = index.to(features.device)
        self._extend_emitted(slots, features.gather(1, index[..., None].expand(-1, -1, features.shape[-1])),
                             result.tokens)
        t4 = time.perf_counter()
        for phase, seconds in zip(self.phase_seconds, (t1 - t0, t2 - t1, t3 - t2, t4 - t3 + owed)):
            self.phase_seconds[phase] += seconds
        self.steps += 1
        accepted = [max(len(path) - 1, 0) for path in result.paths]
        return StepOutput(result.tokens, layout.depths.max(dim=1).values.tolist(), accepted, True, result.errors,
                          deferred_seconds=owed, target_logits=out.logits, target_rows=result.paths)
