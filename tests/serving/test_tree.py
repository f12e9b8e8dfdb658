"""Tree verify on the debug target: the tree mask and positions on hand-built trees, and the
compaction of an accepted path."""

import pytest
import torch

from specray.kernels import decode_cpu
from specray.serving.kv_cache import SlotKVCache, tree_attention_mask
from specray.serving.runner import LlamaRunner
from specray.serving.tree import accept_tree, select_tree, tree_layout


def _prompt(target, text):
    return target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]


def _last_logits(target, ids):
    with torch.inference_mode():
        return target.model(input_ids=torch.tensor([ids])).logits[0, -1]


# two hand-built trees over rows [a, ...]: parents and tokens (the tokens repeat across branches,
# so a row that saw a sibling or a cousin would read a different context)
TREES = [([-1, 0, 0, 1, 1, 2, 3], [50, 60, 70, 80, 90, 60, 70]),
         ([-1, 0, 1, 0], [40, 41, 42, 43])]


def _path(parents, t):
    path = []
    while t >= 0:
        path.append(t)
        t = parents[t]
    return path[::-1]


def test_tree_layout_depths_and_ancestors():
    layout = tree_layout([[-1, 0, 0, 1], [-1, 0]])
    assert layout.depths.tolist() == [[0, 1, 1, 2], [0, 1, 0, 0]]
    assert layout.ancestors[0].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert layout.ancestors[1].int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    with pytest.raises(ValueError, match="not topological"):
        tree_layout([[-1, 2, 0]])


def test_tree_attention_mask_sees_committed_context_and_ancestors_only():
    layout = tree_layout([[-1, 0, 0, 1]])
    mask = tree_attention_mask(torch.tensor([2]), layout.ancestors, 8)[0]  # 2 committed keys, rows at 2..5
    assert mask.int().tolist() == [[1, 1, 1, 0, 0, 0, 0, 0],   # the anchor: context and itself
                                   [1, 1, 1, 1, 0, 0, 0, 0],   # x: a, x
                                   [1, 1, 1, 0, 1, 0, 0, 0],   # y: a, y (not its sibling x)
                                   [1, 1, 1, 1, 0, 1, 0, 0]]   # z: a, x, z


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("order", [[0, 1], [1, 0], [0]])
def test_tree_rows_equal_a_plain_forward_of_their_path(debug_target, order, native):
    """Consecutive slots (cache views), reversed slots (gathered copies) and one request alone;
    the fused kernels' attention (native) and the torch path's."""
    if native and not decode_cpu.available():
        pytest.skip(f"fused CPU kernels unavailable: {decode_cpu.unavailable_reason()}")
    runner = LlamaRunner(debug_target.model, num_slots=2, max_len=256, native=native)
    prompts = [_prompt(debug_target, "Hi"), _prompt(debug_target, "Tell me about castles.")]
    for slot, p in enumerate(prompts):
        runner.forward(torch.tensor([p]), torch.tensor([slot]), torch.tensor([len(p)]))
        runner.cache.commit(slot, len(p))
    trees = [TREES[b] for b in order]
    layout = tree_layout([parents for parents, _ in trees])
    T = layout.depths.shape[1]
    ids = torch.tensor([tokens + [0] * (T - len(tokens)) for _, tokens in trees])
    out = runner.forward(ids, torch.tensor(order), torch.tensor([len(t) for _, t in trees]), tree=layout)
    for j, (b, (parents, tokens)) in enumerate(zip(order, trees)):
        for t in range(len(tokens)):
            path = [tokens[i] for i in _path(parents, t)]
            torch.testing.assert_close(out.logits[j, t], _last_logits(debug_target, prompts[b] + path),
                                       atol=1e-4, rtol=1e-4)


def test_compacted_path_is_the_committed_context(debug_target):
    """Accept the path a -> x -> z (rows 0, 1, 3 of the first tree), compact, commit: the next
    row's logits equal transformers over prompt + path."""
    runner = LlamaRunner(debug_target.model, num_slots=1, max_len=256)
    prompt = _prompt(debug_target, "Hi")
    runner.forward(torch.tensor([prompt]), torch.tensor([0]), torch.tensor([len(prompt)]))
    runner.cache.commit(0, len(prompt))
    parents, tokens = TREES[0]
    runner.forward(torch.tensor([tokens]), torch.tensor([0]), torch.tensor([len(tokens)]), tree=tree_layout([parents]))
    path = _path(parents, 3)
    runner.cache.compact(0, torch.tensor(path))
    runner.cache.commit(0, len(path))
    out = runner.forward(torch.tensor([[7]]), torch.tensor([0]), torch.tensor([1]))
    expected = _last_logits(debug_target, prompt + [tokens[i] for i in path] + [7])
    torch.testing.assert_close(out.logits[0, 0], expected, atol=1e-4, rtol=1e-4)


def test_compact_moves_rows_in_every_layer():
    cache = SlotKVCache(num_layers=2, num_slots=2, max_len=8, num_kv_heads=1, head_dim=1)
    cache.k[:, 1, 0, :, 0] = torch.arange(8.0)
    cache.v[:, 1, 0, :, 0] = -torch.arange(8.0)
    cache.commit(1, 2)
    cache.compact(1, torch.tensor([0, 2, 3, 5]))
    assert cache.k[:, 1, 0, :, 0].tolist() == [[0, 1, 2, 4, 5, 7, 6, 7]] * 2
    assert cache.v[:, 1, 0, :, 0].tolist() == [[-0.0, -1, -2, -4, -5, -7, -6, -7]] * 2
    assert int(cache.committed[1]) == 2 and cache.k[:, 0].abs().sum() == 0


def test_select_tree_keeps_the_best_nodes_with_their_ancestors():
    # nodes in generation order: depth 1 = 0, 1, 2 (anchor's children); depth 2 = 3, 4 (of 0), 5 (of 1)
    parents = torch.tensor([[-1, -1, -1, 0, 0, 1]])
    scores = torch.tensor([[-0.1, -1.0, -2.0, -0.5, -1.0, -1.5]])
    tree = select_tree(torch.tensor([9]), torch.tensor([[10, 11, 12, 13, 14, 15]]), parents, scores, 4)
    # ranks: 0 (-0.1), 3 (-0.5), 1 (-1.0, before its tie 4), 4 -> rows in generation order 0, 1, 3, 4
    assert tree.tokens.tolist() == [[9, 10, 11, 13, 14]] and tree.parents == [[-1, 0, 0, 1, 1]]
    tree = select_tree(torch.tensor([9]), torch.tensor([[10, 11, 12, 13, 14, 15]]), parents, scores, 2)
    assert tree.tokens.tolist() == [[9, 10, 13]] and tree.parents == [[-1, 0, 1]]
    # a child as likely as its parent (log q = 0) comes after it: the parent is kept first
    tie = select_tree(torch.tensor([9]), torch.tensor([[10, 11]]), torch.tensor([[-1, 0]]), torch.tensor([[-1.0, -1.0]]), 1)
    assert tie.tokens.tolist() == [[9, 10]]


def test_accept_tree_greedy_follows_the_argmax_path():
    V = 6
    tokens, parents = [0, 1, 2, 3, 4, 5], [-1, 0, 0, 2, 2, 4]  # 0 -> {1, 2}; 2 -> {3, 4}; 4 -> {5}
    logits = torch.zeros(6, V)
    logits[0, 2] = logits[2, 4] = logits[4, 0] = 1.0  # the anchor row wants 2, row 2 wants 4, row 4 wants 0
    assert accept_tree(logits, tokens, parents, greedy=True) == ([0, 2, 4], [2, 4, 0])
    logits[4, 5] = 2.0  # row 4 wants 5, its child: the whole path and the leaf's bonus (argmax of row 5: 0)
    assert accept_tree(logits, tokens, parents, greedy=True) == ([0, 2, 4, 5], [2, 4, 5, 0])
    logits[0, 3] = 3.0  # the anchor row wants 3: no child holds it, the correction 3
    assert accept_tree(logits, tokens, parents, greedy=True) == ([0], [3])


# -- sampled: the output distribution over a small vocabulary ---------------------------------------

V_SMALL = 5


def _distributions(seed):
    g = torch.Generator().manual_seed(seed)
    p_root = (torch.randn(V_SMALL, generator=g) * 0.8).softmax(-1)
    p_next = (torch.randn(V_SMALL, V_SMALL, generator=g) * 0.8).softmax(-1)  # [x, V]: the target after token x
    q = (torch.randn(V_SMALL, generator=g) * 2.5).softmax(-1)  # the draft distribution: peaked, far from p
    return p_root, p_next, q


def _without(q, tokens):
    q = q.clone()
    q[tokens] = 0.0
    return q / q.sum()


def _chi2_of_two_tokens(draw_tree, q_rule, trials=12_000, seed=0):
    """Two tokens per trial: a tree round over depth-2 trees (``draw_tree``), then — when the round
    emitted one token — a plain draw. Returns chi2 against p(t1) p(t2 | t1) (24 degrees of freedom)."""
    p_root, p_next, q = _distributions(3)
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V_SMALL, V_SMALL)
    for _ in range(trials):
        tokens, parents = draw_tree(q, g)
        target = torch.stack([p_root] + [p_next[x] for x in tokens[1:]])  # each row's target after its own token
        _, emitted = accept_tree(target, tokens, parents, greedy=False, draft_probs=q_rule(q, tokens, parents),
                                 generator=g)
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(p_next[emitted[0]], 1, generator=g)))
        counts[emitted[0], emitted[1]] += 1
    expected = trials * p_root[:, None] * p_next
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_24_P001 = 51.18  # chi-square, 24 degrees of freedom, p = 0.001


def _sampled_tree(q, g):
    """Two children of the anchor drawn without replacement from q, two of the first child likewise."""
    first = torch.multinomial(q, 2, replacement=False, generator=g).tolist()
    second = torch.multinomial(q, 2, replacement=False, generator=g).tolist()
    return [0] + first + second, [-1, 0, 0, 1, 1]


def _q_without_replacement(q, tokens, parents):
    """Each node's q: the draft distribution without its earlier siblings' tokens."""
    rows = [torch.zeros(V_SMALL)]
    for t in range(1, len(tokens)):
        earlier = [tokens[s] for s in range(1, t) if parents[s] == parents[t]]
        rows.append(_without(q, earlier))
    return torch.stack(rows)


def test_tree_rejection_keeps_the_targets_distribution_for_sampled_siblings():
    assert _chi2_of_two_tokens(_sampled_tree, _q_without_replacement) < CHI2_24_P001


def test_tree_rejection_with_a_wrong_sibling_q_changes_the_distribution():
    """The second sibling's q taken as the unchanged q (its draw excluded the first sibling's token)."""
    stale = lambda q, tokens, parents: torch.stack([torch.zeros(V_SMALL)] + [q] * (len(tokens) - 1))
    assert _chi2_of_two_tokens(_sampled_tree, stale) > 3 * CHI2_24_P001


def _top_tree(q, g):
    """Deterministic candidates: the two most likely tokens under q as the anchor's children, the
    two most likely as the first child's children."""
    top = q.topk(2).indices.tolist()
    return [0] + top + top, [-1, 0, 0, 1, 1]


def test_tree_rejection_of_deterministic_candidates_keeps_the_targets_distribution():
    assert _chi2_of_two_tokens(_top_tree, lambda q, tokens, parents: None) < CHI2_24_P001


def test_tree_rejection_of_deterministic_candidates_with_the_drafts_softmax_as_q_is_wrong():
    assert _chi2_of_two_tokens(_top_tree, _q_without_replacement) > 3 * CHI2_24_P001
