"""A drafter published in a peer format, used as specray's own (drafters/peer_import.py): a z-lab
DFlash directory (written by z-lab's ``dflash`` package) fine-tunes with ``drafter.init_from``
pointed at it, evaluates with ``specray evaluate`` on it, and its import serves losslessly on our
engine and through the registry; speculators' DFlash and EAGLE-3 directories (written by the
``speculators`` package's own save) import with ``specray import`` and serve losslessly, drafting
every round; all on the debug target."""

import json

import pytest
import torch
from dflash import DFlashDraftModel
from peer_parity import by_name, randomise
from transformers import Qwen3Config

from specray.capture.store import read_manifest
from specray.drafters.dflash import choose_mask_token
from specray.drafters.format import load_drafter
from specray.drafters.peer_import import import_peer
from specray.pipeline.cli import main
from specray.pipeline.jobs.train import build_trainer
from specray.serving.engine import Engine
from specray.serving.registry import DrafterRegistry
from specray.serving.sampling import SamplingParams

from test_training import _capture, _cfg  # noqa: E402  (the debug capture and training config of specray train)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return _capture(tmp_path_factory.mktemp("features"))


@pytest.fixture
def zlab_dir(debug_target, tmp_path):
    """A z-lab DFlash drafter of the quickstart section's architecture on the debug target (1 layer,
    the target's heads and MLP width, B = 8), at the manifest's layers, MASK = the section's default."""
    tcfg = debug_target.model.config
    config = Qwen3Config(vocab_size=debug_target.vocab_size, hidden_size=64, intermediate_size=tcfg.intermediate_size,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=tcfg.rms_norm_eps, max_position_embeddings=4096, tie_word_embeddings=False)
    config.architectures, config.num_target_layers, config.block_size = ["DFlashDraftModel"], 8, 8
    mask, _ = choose_mask_token(debug_target.tokenizer, debug_target.vocab_size)
    config.dflash_config = {"target_layer_ids": [1, 2, 3, 4, 5], "mask_token_id": mask}
    torch.manual_seed(0)  # before the model's own initialisation: the draws below continue that stream
    randomise(DFlashDraftModel(config), by_name(0.1), seed=None).save_pretrained(tmp_path / "zlab")
    return tmp_path / "zlab"


def test_init_from_a_peer_directory_fine_tunes_from_its_weights(manifest, zlab_dir, tmp_path, debug_target):
    tuned = build_trainer(_cfg(manifest, tmp_path / "tuned", f"drafter.init_from={zlab_dir}", "optim.total_steps=2"))
    imported = import_peer(zlab_dir, tmp_path / "imported", target=debug_target, capture_dtype="float32")
    reference = load_drafter(imported, embed_tokens=debug_target.model.model.embed_tokens,
                             lm_head=debug_target.model.lm_head, target_fingerprint=debug_target.target_fingerprint,
                             template_fingerprint=debug_target.template_fingerprint)
    torch.testing.assert_close(tuned.core.model.state_dict(), reference.state_dict(), rtol=0, atol=0)
    tuned.fit(progress=False)
    tuned.loader.close()
    assert (tmp_path / "tuned" / "checkpoints").is_dir()
    with pytest.raises(ValueError, match=r"another architecture \(block_size: export 8 vs config 4\)"):
        build_trainer(_cfg(manifest, tmp_path / "other", f"drafter.init_from={zlab_dir}", "drafter.block_size=4"))
    with pytest.raises(ValueError, match=r"another architecture \(mask_token_id: export 195 vs config 0\)"):
        build_trainer(_cfg(manifest, tmp_path / "mask", f"drafter.init_from={zlab_dir}", "drafter.mask_token_id=0"))


def test_evaluate_a_peer_directory_and_its_import(manifest, zlab_dir, tmp_path, debug_target, capsys):
    assert main(["evaluate", str(zlab_dir), "--manifest", str(manifest), "--target", "debug",
                 "--json", str(tmp_path / "eval.json")]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["samples"] == len(read_manifest(str(manifest)).refs) and 1.0 <= result["tau_tf"] <= 8.0
    assert "imported" in capsys.readouterr().out
    imported = import_peer(zlab_dir, tmp_path / "imported", target=debug_target, capture_dtype="float32")
    assert main(["evaluate", str(imported), "--manifest", str(manifest), "--target", "debug"]) == 0
    evaluation = json.loads((imported / "evaluation.json").read_text())
    assert evaluation["heldout"]["tau_tf"] == pytest.approx(result["tau_tf"])
    assert f"| tau, held-out (teacher-forced) | {evaluation['heldout']['tau_tf']:.3f}" in \
        (imported / "README.md").read_text()


def test_an_imported_drafter_serves_losslessly_and_publishes(zlab_dir, tmp_path, debug_target):
    imported = import_peer(zlab_dir, tmp_path / "imported", target=debug_target)
    prompts = [[1, 72, 101, 108, 108, 111], [1, 87, 104, 97, 116, 32, 105, 115]]
    params = SamplingParams(max_tokens=24)
    plain = [o.token_ids for o in Engine(debug_target, None, max_batch=2).generate(prompts, params)]
    engine = Engine(debug_target, str(imported), max_batch=2, speculation="static")
    speculative = engine.generate(prompts, params)
    assert engine.versions.active.algorithm == "dflash"  # drafted every round with the imported drafter
    assert [o.token_ids for o in speculative] == plain  # greedy speculative == greedy target
    registry = DrafterRegistry(str(tmp_path / "registry"))
    version = registry.publish(imported)  # the model card travels with the version
    pulled = registry.pull(version, tmp_path / "pulled")
    assert (pulled / "README.md").is_file()
    load_drafter(pulled, embed_tokens=debug_target.model.model.embed_tokens, lm_head=debug_target.model.lm_head,
                 target_fingerprint=debug_target.target_fingerprint,
                 template_fingerprint=debug_target.template_fingerprint)


def _speculators_dir(target, algorithm: str, path):
    """A drafter written by speculators' own ``from_training_args`` + ``save_pretrained`` (one full-attention
    draft layer over the target's layer inputs 2, 5, 6, a draft vocabulary of the even ids, the target's
    directory as verifier), its weights spread (norms around 1, the rest around 0; embedding and head kept)."""
    from speculators.models.dflash import DFlashDraftModel as SpeculatorsDFlash
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.cli import create_transformer_layer_config

    vocab = torch.arange(0, target.vocab_size, 2)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    common = dict(t2d=t2d, d2t=vocab - torch.arange(len(vocab)), verifier_name_or_path=str(target.path),
                  draft_vocab_size=len(vocab), target_layer_ids=[2, 5, 6])
    if algorithm == "dflash":
        layer = create_transformer_layer_config(str(target.path), 1, "qwen3", None, None, [0])
        mask, _ = choose_mask_token(target.tokenizer, target.vocab_size)
        model = SpeculatorsDFlash.from_training_args(layer, block_size=4, mask_token_id=mask, **common)
    else:
        layer = create_transformer_layer_config(str(target.path), 1, "llama", None, None, [0])
        model = Eagle3DraftModel.from_training_args(layer, norm_before_residual=False, ttt_steps=3, **common)
    randomise(model, by_name(0.2, keep=("embed", "lm_head", "verifier"))).save_pretrained(path)
    return path


@pytest.mark.parametrize("algorithm", ["dflash", "eagle3"])
def test_a_speculators_drafter_imports_and_serves_losslessly(algorithm, tmp_path, debug_target, capsys):
    peer_dir = _speculators_dir(debug_target, algorithm, tmp_path / "speculators")
    assert main(["import", str(peer_dir), "--out", str(tmp_path / "imported"), "--target", "debug"]) == 0
    assert f"speculators {algorithm}" in capsys.readouterr().out
    prompts = [[1, 72, 101, 108, 108, 111], [1, 87, 104, 97, 116, 32, 105, 115]]
    params = SamplingParams(max_tokens=12)
    plain = [o.token_ids for o in Engine(debug_target, None, max_batch=2).generate(prompts, params)]
    engine = Engine(debug_target, str(tmp_path / "imported"), max_batch=2, speculation="static")
    speculative = engine.generate(prompts, params)
    assert [o.token_ids for o in speculative] == plain  # greedy speculative == greedy target
    stats = engine.stats()
    assert stats["algorithm"] == algorithm and all(o.drafter_version is not None for o in speculative)
    versions = stats["versions"][0]
    # every step a speculative round with drafts (acceptance counted per draft position), none plain
    assert versions["rounds"] == sum(o.rounds for o in speculative) > 0 and versions["plain_steps"] == 0
    assert len(versions["acceptance_by_position"]) >= 1

