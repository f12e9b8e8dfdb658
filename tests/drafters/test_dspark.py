"""DSpark drafter (drafters/dspark.py): the anchor-predict layout, the sequence heads (a fresh one is
the backbone; teacher-forced rows equal left-to-right drafting), the q drafting returns, the config."""

from dataclasses import replace

import pytest
import torch

from specray.drafters import dspark

HEADS = ["vanilla", "gated", "rnn"]


def _drafter(target, head="vanilla", randomise=True, **overrides):
    cfg = replace(dspark.debug_config(target), markov_head_type=head, **overrides)
    torch.manual_seed(0)
    model = dspark.DSparkDrafter(cfg, embed_tokens=target.model.get_input_embeddings(),
                                 lm_head=target.model.get_output_embeddings())
    if randomise:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith(("markov_head", "confidence_head")):
                    p.normal_(0.0, 0.5)
    return model.eval()


def _inputs(target, S=20):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, S, 3 * target.hidden_size, generator=g)
    ids = torch.randint(0, target.vocab_size, (2, S), generator=g)
    anchors = torch.tensor([[2, 9], [5, -1]])
    return hidden, ids, anchors


@pytest.mark.parametrize("head", HEADS)
def test_a_fresh_sequence_head_gives_the_backbone_distribution(debug_target, head):
    model = _drafter(debug_target, head, randomise=False)
    assert torch.equal(model.markov_head.markov_w2.weight, torch.zeros_like(model.markov_head.markov_w2.weight))
    hidden, ids, anchors = _inputs(debug_target)
    prev = torch.randint(0, debug_target.vocab_size, (2, 2, 4))
    with torch.no_grad():
        logits, confidence = model(hidden, torch.ones(2, 20, dtype=torch.bool), ids.gather(1, anchors.clamp(min=0)),
                                   anchors, prev)
        backbone = model.logits(model.block_hidden(hidden, torch.ones(2, 20, dtype=torch.bool),
                                                   ids.gather(1, anchors.clamp(min=0)), anchors))
    assert logits.shape == (2, 2, 4, debug_target.vocab_size) and confidence.shape == (2, 2, 4)
    assert torch.equal(logits, backbone)  # every one of the B rows predicts (the anchor row too)


@pytest.mark.parametrize("head", HEADS)
def test_drafting_left_to_right_equals_the_teacher_forced_rows(debug_target, head):
    """Drafting tokens d1 … dk through the head gives the logits and confidences training computes
    with prev = [a, d1 … d(k−1)]; the q each draft came from is that corrected softmax."""
    model = _drafter(debug_target, head)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 4, debug_target.hidden_size, generator=g)  # [Bt, k, D]
    anchors = torch.tensor([5, 17, 200])
    forced = torch.randint(0, debug_target.vocab_size, (3, 4), generator=g)
    seen = []

    def pick(logits, k):
        seen.append(logits)
        return forced[:, k], logits.softmax(-1)

    with torch.no_grad():
        drafts, q, confidence = model.draft(hidden, anchors, pick, greedy=False)
        prev = torch.cat([anchors[:, None], forced[:, :-1]], dim=1)
        logits, conf_logits = model.corrected(hidden, prev)
    assert torch.equal(drafts, forced)
    torch.testing.assert_close(torch.stack(seen, 1), logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q, logits.softmax(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(confidence, torch.sigmoid(conf_logits), rtol=1e-5, atol=1e-6)
    assert (q - model.logits(hidden).softmax(-1)).abs().max() > 1e-3  # not the backbone's softmax


def test_the_head_conditions_on_the_previous_token(debug_target):
    model = _drafter(debug_target)
    hidden = torch.randn(1, 2, debug_target.hidden_size)
    with torch.no_grad():
        a, _ = model.corrected(hidden, torch.tensor([[3, 4]]))
        b, _ = model.corrected(hidden, torch.tensor([[3, 9]]))
    assert torch.equal(a[:, 0], b[:, 0]) and not torch.allclose(a[:, 1], b[:, 1])


def test_config_round_trip_and_refusals(debug_target):
    cfg = replace(dspark.debug_config(debug_target), markov_head_type="rnn", confidence_head_with_markov=False)
    assert dspark.DSparkConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.num_draft_tokens == cfg.block_size  # the anchor row drafts too
    with pytest.raises(ValueError, match="markov_rank"):
        replace(cfg, markov_rank=0)
    with pytest.raises(ValueError, match="markov_head_type"):
        replace(cfg, markov_head_type="lstm")
    model = _drafter(debug_target, confidence_head_with_markov=False)
    assert model.confidence_head.proj.weight.shape == (1, debug_target.hidden_size)


def test_draft_vocabulary_sizes_the_head(debug_target):
    model = _drafter(debug_target, draft_vocab_size=7)
    model.set_draft_vocab(torch.arange(0, 70, 10))
    assert model.markov_head.markov_w1.weight.shape[0] == debug_target.vocab_size  # indexed by target ids
    assert model.markov_head.markov_w2.weight.shape[0] == 7
    drafts, q, _ = model.draft(torch.randn(2, 3, debug_target.hidden_size), torch.tensor([1, 2]),
                               lambda logits, k: (logits.argmax(-1), logits.softmax(-1)), greedy=False)
    assert q.shape == (2, 3, 7) and (drafts % 10 == 0).all()


def test_section_builds_the_config(debug_target):
    section = dspark.DSparkSection(markov_rank=8, markov_head_type="gated", block_size=6, num_layers=1)
    cfg = section.drafter_config(debug_target, (1, 3, 5))
    assert isinstance(cfg, dspark.DSparkConfig)
    assert (cfg.markov_rank, cfg.markov_head_type, cfg.block_size, cfg.target_layer_ids) == (8, "gated", 6, (1, 3, 5))
    with pytest.raises(ValueError, match="block_size"):
        dspark.DSparkSection(block_size=1)


def test_each_request_reads_the_temperature_table_of_its_mode(debug_target):
    """Row 0 of confidence_temperature is the greedy table, row 1 the sampling one; a batch mixing both
    modes gets each row's own temperatures."""
    model = _drafter(debug_target)
    with torch.no_grad():
        model.confidence_temperature.copy_(torch.tensor([[2.0] * 4, [0.5] * 4]))
    hidden = torch.randn(2, 3, debug_target.hidden_size, generator=torch.Generator().manual_seed(5))
    anchors = torch.tensor([4, 9])

    def pick(logits, k):
        return logits.argmax(-1), None

    with torch.no_grad():
        drafts, _, mixed = model.draft(hidden, anchors, pick, greedy=torch.tensor([True, False]))
        _, conf_logits = model.corrected(hidden, torch.cat([anchors[:, None], drafts[:, :-1]], dim=1))
        greedy = model.draft(hidden, anchors, pick, greedy=True)[2]
    torch.testing.assert_close(mixed[0], torch.sigmoid(conf_logits[0] / 2.0), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed[1], torch.sigmoid(conf_logits[1] / 0.5), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(greedy[1], torch.sigmoid(conf_logits[1] / 2.0), rtol=1e-5, atol=1e-6)
