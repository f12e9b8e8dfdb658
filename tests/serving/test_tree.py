"""Tree verify on the debug target: the tree mask and positions on hand-built trees, and the
compaction of an accepted path."""

import pytest
import torch

from specray.serving.kv_cache import SlotKVCache, tree_attention_mask
from specray.serving.runner import LlamaRunner
from specray.serving.tree import tree_layout


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


@pytest.mark.parametrize("order", [[0, 1], [1, 0], [0]])
def test_tree_rows_equal_a_plain_forward_of_their_path(debug_target, order):
    """Consecutive slots (cache views), reversed slots (gathered copies) and one request alone."""
    runner = LlamaRunner(debug_target.model, num_slots=2, max_len=256)
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
