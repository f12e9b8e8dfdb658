"""Export conformance of every registered drafter:

- our format (``drafters/format.py``): a trained drafter's export loads back with the same weights,
  the same training logits (its strategy's loss and metrics, bit for bit) and the same served
  proposals (drafts and q of a sampled round); an export checked against another target is refused;
- the peer format (``drafters/peer.py``, speculators 0.9.0): where the algorithm has a peer layout,
  the speculators model loaded from the export computes our logits (max |Δ| <= 1e-4) with and
  without a draft vocabulary, and each configuration the peer cannot express is refused; an
  algorithm without a peer layout is refused.

A peer layout's parity needs a harness here (``PEER_PARITY``): how to run the speculators model
on the same features and tokens as ours. A layout without one fails the suite.
"""

import json
from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch
from conformance_kit import export, recorded_verification
from peer_parity import TOLERANCE, ascending, features, fix_anchors, peer_model, random_vocab, randomise

from specray.capture.contract import CONTRACT_SPECS
from specray.capture.store import open_store, read_manifest
from specray.drafters import DRAFTERS
from specray.drafters.format import InvalidDrafterError, load_drafter
from specray.drafters.peer import PEER_LAYOUTS, PeerFormatError, write_peer_export
from specray.serving.runner import LlamaRunner
from specray.serving.sampling import SamplingParams
from specray.serving.workers import WORKERS
from specray.trainer.checkpoint import load_checkpoint
from specray.trainer.export import drafter_from_state, export_checkpoint
from specray.trainer.loader import FeatureLoader
from specray.trainer.strategies import STRATEGIES


def _shared(target) -> dict:
    return {"embed_tokens": target.model.get_input_embeddings(), "lm_head": target.model.get_output_embeddings()}


def _served_proposals(target, drafter, algorithm, prompt: list[int]) -> dict:
    """The drafts and q one sampled round hands to verification."""
    runner = LlamaRunner(target.model, num_slots=1, max_len=256, capture_layer_ids=drafter.config.target_layer_ids)
    worker = WORKERS[algorithm](runner, drafter)
    anchor = int(worker.prefill([0], [prompt])[0].argmax())
    with recorded_verification() as seen:
        worker.step([0], [anchor], [SamplingParams(temperature=1.0)], [torch.Generator().manual_seed(3)],
                    worker.verify_sizes[-1])
    assert len(seen) == 1, "a speculative round verifies through kernels/rejection.py::rejection_sample"
    return seen[0]


def test_export_round_trip_in_our_format(debug_target, debug_runs, algorithm, tmp_path):
    run, straight = debug_runs(algorithm)
    checkpoint = load_checkpoint(straight / "checkpoints")
    trained = drafter_from_state(algorithm, checkpoint.extra["drafter_config"], checkpoint.model,
                                 **_shared(debug_target)).eval()
    out = export_checkpoint(straight, tmp_path / "export")
    manifest = read_manifest(str(run.manifest))
    contract = json.loads(manifest.contract.to_json())
    fingerprints = {"target_fingerprint": debug_target.target_fingerprint,
                    "template_fingerprint": debug_target.template_fingerprint}
    loaded = load_drafter(out, contract=contract, **fingerprints, **_shared(debug_target))
    assert type(loaded) is DRAFTERS[algorithm].model and loaded.config == trained.config
    state = trained.state_dict()
    assert loaded.state_dict().keys() == state.keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())

    strategy = STRATEGIES[algorithm](STRATEGIES[algorithm].objective.model_validate(checkpoint.extra["provenance"]
                                                                                      ["config"]["objective"]))
    with FeatureLoader(manifest, open_store(manifest.store_uri), micro_batch_size=2, seed=0) as loader:
        batch = loader.next_batch()
    with torch.no_grad():
        ours = [strategy.forward_loss(m, m.config, batch, strategy.generator(0, 0)) for m in (trained, loaded)]
    assert torch.equal(ours[0][0], ours[1][0]) and ours[0][0] > 0
    assert all(torch.equal(ours[0][1][k], ours[1][1][k]) for k in ours[0][1])

    prompt = batch.input_ids[0, :24].tolist()
    a, b = (_served_proposals(debug_target, m, algorithm, prompt) for m in (trained, loaded))
    assert torch.equal(a["drafts"], b["drafts"]) and torch.equal(a["q"], b["q"])

    with pytest.raises(InvalidDrafterError, match="trained for another target"):
        load_drafter(out, **dict(fingerprints, target_fingerprint="sha256:another"), **_shared(debug_target))


# -- the peer format ----------------------------------------------------------------------------


def _features(target, layer_ids, S: int):
    """Random features [1, S, L·D] in our (contract) order and in the peer's (ascending layers), tokens [1, S]."""
    hidden, ids, _ = features(target, S, layer_ids)
    return hidden, ascending(hidden, layer_ids), ids


def _dflash_logits(model, path, target, monkeypatch):
    """Blocks anchored at fixed positions: ours [1, N, B−1, V_d], the peer's backbone logits without the anchor rows."""
    from speculators.models.dflash import DFlashDraftModel

    peer = peer_model(DFlashDraftModel, path)
    S, B, anchors = 24, model.config.block_size, torch.tensor([3, 9, 15])
    hidden, ascending, ids = _features(target, model.config.target_layer_ids, S)
    ours = model(hidden, torch.ones(1, S, dtype=torch.bool), ids[:, anchors], anchors[None])
    fix_anchors(monkeypatch, anchors)
    _, logits, *_ = peer._backbone_forward(ascending, ids, torch.ones(1, S), torch.randn(1, S, target.hidden_size),
                                           torch.zeros(1, S, dtype=torch.long), max_anchors=len(anchors))
    return ours, logits.view(1, len(anchors), B, -1)[:, :, 1:]


def _dflash2_logits(model, path, target, monkeypatch):
    """DFlash's blocks: the unary logits, and the same with each position's K candidates rescored by the
    selector after given predecessors: [2, 1, N, B−1, V] each."""
    from speculators.models.dflash2 import DFlash2DraftModel

    peer = peer_model(DFlash2DraftModel, path)
    S, B, anchors = 24, model.config.block_size, torch.tensor([3, 9, 15])
    hidden, ascending, ids = _features(target, model.config.target_layer_ids, S)
    g = torch.Generator().manual_seed(4)
    predecessors = torch.randint(0, target.vocab_size, (1, len(anchors), B - 1), generator=g)  # [1, N, m]
    out = model(hidden, torch.ones(1, S, dtype=torch.bool), ids[:, anchors], anchors[None], predecessors)
    fix_anchors(monkeypatch, anchors)
    h, logits, *_ = peer._backbone_forward(ascending, ids, torch.ones(1, S), torch.randn(1, S, target.hidden_size),
                                           torch.zeros(1, S, dtype=torch.long), max_anchors=len(anchors))
    logits, h = logits.view(1, len(anchors), B, -1)[:, :, 1:], h.view(1, len(anchors), B, -1)[:, :, 1:]
    scores = peer.candidate_selector.score_candidates(logits, h, predecessors, model.draft_to_target(out.candidates))
    return (torch.stack([out.logits, out.logits.scatter(-1, out.candidates, out.scores)]),
            torch.stack([logits, logits.scatter(-1, out.candidates, scores)]))


def _dspark_logits(model, path, target, monkeypatch):
    """Blocks anchored at fixed positions, every row through the sequence head after the data's previous
    token (the peer's whole forward, its loss replaced by a recorder): [2, 1, N, B, V_d], the corrected
    logits and each row's confidence logit broadcast over the vocabulary."""
    from speculators.models.dspark import DSparkDraftModel
    from speculators.models.dspark import core as peer_dspark

    peer = peer_model(DSparkDraftModel, path)
    S, B, anchors = 24, model.config.block_size, torch.tensor([3, 9, 15])
    hidden, ascending, ids = _features(target, model.config.target_layer_ids, S)
    prev = ids[:, anchors[:, None] + torch.arange(B)]  # [1, N, B]: row k follows the token at anchor + k
    logits, confidence = model(hidden, torch.ones(1, S, dtype=torch.bool), ids[:, anchors], anchors[None], prev)
    fix_anchors(monkeypatch, anchors)
    seen = {}
    monkeypatch.setattr(peer_dspark, "compute_metrics", lambda logits, targets, confidence, *args, **kwargs:
                        seen.update(logits=logits, confidence=confidence) or (logits.sum(), {}))
    peer(ascending, ids, torch.ones(1, S), torch.randn(1, S, target.hidden_size), torch.zeros(1, S, dtype=torch.long),
         max_anchors=len(anchors))
    theirs = seen["logits"].view(1, len(anchors), B, -1), seen["confidence"].view(1, len(anchors), B)
    return (torch.stack([logits, confidence[..., None].expand_as(logits)]),
            torch.stack([theirs[0], theirs[1][..., None].expand_as(theirs[0])]))


def _eagle3_logits(model, path, target, monkeypatch):
    """Three training-time-test steps (the later ones fed the drafter's own states): [steps, S, V_d] each."""
    from speculators.models.eagle3 import Eagle3DraftModel

    peer = peer_model(Eagle3DraftModel, path)
    S, steps = 12, 3
    hidden, ascending, ids = _features(target, model.config.target_layer_ids, S)
    ours = torch.stack(model(hidden, ids, torch.ones(steps, 1, S, dtype=torch.bool)))
    theirs = []  # the peer returns draft tokens; its LM head's outputs are the logits
    hook = peer.lm_head.register_forward_hook(lambda module, args, output: theirs.append(output[0]))
    # the peer's row t pairs state t with token t (its data is shifted): ours reads x_{t+1} there
    peer(ascending, torch.cat([ids[:, 1:], ids.new_zeros(1, 1)], dim=1), torch.zeros(1, S, dtype=torch.long),
         ttt_steps=steps)
    hook.remove()
    return ours, torch.stack(theirs)


@dataclass(frozen=True)
class PeerParity:
    """How to compare one algorithm with its speculators model.

    ``logits(model, peer_dir, target, monkeypatch) -> (ours, theirs)`` on the same inputs;
    ``expressible``: config overrides the peer can express (the parity runs with them);
    ``refused``: overrides (on top of those) that the export must refuse;
    ``draft_vocab``: whether the peer expresses a draft vocabulary (False: an export with one is refused).
    """

    logits: Callable
    expressible: dict = field(default_factory=dict)
    refused: tuple[dict, ...] = ()
    draft_vocab: bool = True


PEER_PARITY = {
    "dflash": PeerParity(_dflash_logits, expressible={"block_key_bias": 0.0},
                         refused=({"block_key_bias": 4.0}, {"attention": "sliding", "sliding_window": 8})),
    "dflash2": PeerParity(_dflash2_logits, expressible={"block_key_bias": 0.0},
                          refused=({"block_key_bias": 4.0}, {"attention": "sliding", "sliding_window": 8}),
                          draft_vocab=False),
    "dspark": PeerParity(_dspark_logits, expressible={"block_key_bias": 0.0},
                         refused=({"block_key_bias": 4.0}, {"attention": "sliding", "sliding_window": 8})),
    "eagle3": PeerParity(_eagle3_logits),
}


def _matrices_and_norms(name: str, p: torch.Tensor) -> tuple[float, float] | None:
    """Matrices around 0, norms around 1, both with std 0.2; other parameters (e.g. a learned bias)
    keep their value from the config."""
    if p.dim() == 2:
        return 0.0, 0.2
    return (1.0, 0.2) if "norm" in name else None


def _peer_drafter(algorithm, target, overrides: dict, draft_vocab: list[int] | None):
    """A drafter whose weights spread its logits over several units (a 1e-4 match means something);
    layer ids in reverse (the peer's fc takes its inputs in ascending layer order)."""
    spec = DRAFTERS[algorithm]
    layer_ids = tuple(reversed(CONTRACT_SPECS[algorithm].default_layer_ids(target.num_layers)))
    config = spec.debug_config(target, layer_ids).to_dict()
    config.update(overrides, draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
    model = randomise(spec.model(spec.config.from_dict(config), **_shared(target)), _matrices_and_norms)
    if draft_vocab is not None:
        model.set_draft_vocab(torch.tensor(draft_vocab))
    return model.eval()


@pytest.mark.parametrize("vocab", ["full_vocab", "draft_vocab"])
def test_peer_export_matches_the_speculators_model(debug_target, algorithm, vocab, tmp_path, monkeypatch):
    draft_vocab = None
    if vocab == "draft_vocab":
        draft_vocab = random_vocab(debug_target, 40).tolist()
    if algorithm not in PEER_LAYOUTS:
        model = _peer_drafter(algorithm, debug_target, {}, draft_vocab)
        with pytest.raises(PeerFormatError, match="has no speculators layout"):
            write_peer_export(export(model, debug_target, tmp_path / "export"), tmp_path / "peer", target=debug_target,
                              verifier_name_or_path=str(debug_target.path))
        return
    assert algorithm in PEER_PARITY, (f"{algorithm} has a speculators layout (drafters/peer.py) but no parity "
                                      "harness: add it to PEER_PARITY in tests/conformance/test_conformance_export.py")
    case = PEER_PARITY[algorithm]
    if draft_vocab is not None and not case.draft_vocab:
        model = _peer_drafter(algorithm, debug_target, case.expressible, draft_vocab)
        with pytest.raises(PeerFormatError, match="cannot be exported in the speculators format"):
            write_peer_export(export(model, debug_target, tmp_path / "export"), tmp_path / "peer", target=debug_target,
                              verifier_name_or_path=str(debug_target.path))
        return
    for i, refused in enumerate(case.refused):
        model = _peer_drafter(algorithm, debug_target, {**case.expressible, **refused}, draft_vocab)
        with pytest.raises(PeerFormatError, match="cannot be exported in the speculators format"):
            write_peer_export(export(model, debug_target, tmp_path / f"refused{i}"), tmp_path / f"peer{i}",
                              target=debug_target, verifier_name_or_path=str(debug_target.path))
        assert not (tmp_path / f"peer{i}").exists()
    model = _peer_drafter(algorithm, debug_target, case.expressible, draft_vocab)
    out = write_peer_export(export(model, debug_target, tmp_path / "export"), tmp_path / "peer", target=debug_target,
                            verifier_name_or_path=str(debug_target.path))
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == PEER_LAYOUTS[algorithm].model_type
    assert config["draft_vocab_size"] == (len(draft_vocab) if draft_vocab else debug_target.vocab_size)
    with torch.no_grad():
        ours, theirs = case.logits(model, out, debug_target, monkeypatch)
    assert ours.shape == theirs.shape and ours.shape[-1] == config["draft_vocab_size"] and ours.std() > 0.5
    assert (ours - theirs).abs().max() <= TOLERANCE
