"""``specray push`` (trainer/hub.py) against a local server that speaks the Hub's upload API
(tests/trainer/hub_server.py) through the real huggingface_hub client: the repo revision holds
exactly the export and its model card, verified by size and hash; a store that loses bytes is
caught; a corrupt export is refused before anything is sent.

    HF_ENDPOINT=http://127.0.0.1:PORT HF_HUB_DISABLE_XET=1 specray push EXPORT --repo me/x --token T
"""

import hashlib
import json

import huggingface_hub.constants
import pytest

from specray.capture.contract import build_contract
from specray.drafters import DRAFTERS
from specray.drafters.card import record_evaluation
from specray.drafters.format import save_drafter
from specray.drafters.peer import write_peer_export
from specray.pipeline.cli import main
from specray.trainer.hub import PushVerificationError, push_export

from hub_server import MockHub  # noqa: E402

TOKEN = "hf_local_test_token"


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)  # the local server has no Xet store
    server = MockHub(token=TOKEN)
    yield server
    server.close()


def _export(tmp_path, target, name="export", provenance=None):
    spec = DRAFTERS["dflash"]
    cfg = spec.debug_config(target)
    model = spec.model(cfg, embed_tokens=target.model.get_input_embeddings(), lm_head=target.model.get_output_embeddings())
    contract = build_contract("dflash", target_fingerprint=target.target_fingerprint,
                              template_fingerprint=target.template_fingerprint, num_target_layers=target.num_layers,
                              hidden_size=target.hidden_size, layer_ids=cfg.target_layer_ids, dtype="float32")
    return save_drafter(tmp_path / name, model, contract=json.loads(contract.to_json()),
                        provenance=provenance or {"run": "test", "target": "debug", "step": 12, "tokens_seen": 3456,
                                                  "last_metrics": {"step": 12, "tau_tf": 2.5}})


def test_push_uploads_the_export_and_its_card_and_verifies(debug_target, tmp_path, hub):
    export = _export(tmp_path, debug_target)
    result = push_export(export, "me/drafter", token=TOKEN, endpoint=hub.url, private=True)
    remote = hub.files("me/drafter")
    local = {p.name: p.read_bytes() for p in export.iterdir()}
    assert set(remote) == set(local) | {".gitattributes"}
    assert all(remote[name] == local[name] for name in local if name != "README.md")
    card = remote["README.md"].decode()
    assert card.startswith("---\nlibrary_name: specray") and "| tau, teacher-forced (training) | 2.500 at step 12 |" in card
    assert hub.repos["me/drafter"]["private"] is True and hub.repos["me/drafter"]["branches"]["main"][
        "model.safetensors"][1] is True  # the weights went through LFS
    weights = (export / "model.safetensors").read_bytes()
    assert result.files["model.safetensors"] == {"size": len(weights),
                                                 "sha256": "sha256:" + hashlib.sha256(weights).hexdigest()}
    assert result.revision == "main" and result.commit


def test_push_to_a_revision_holds_exactly_the_export(debug_target, tmp_path, hub):
    first = _export(tmp_path, debug_target, "first")
    record_evaluation(first, {"tau_live": 3.1, "live_dataset": "mtbench", "live_prompts": 4,
                              "live_num_speculative_tokens": 3})
    push_export(first, "me/drafter", token=TOKEN, endpoint=hub.url, revision="v1")
    assert "evaluation.json" in hub.files("me/drafter", "v1") and "| tau, live (serving engine, greedy) | 3.100" in \
        hub.files("me/drafter", "v1")["README.md"].decode()
    second = _export(tmp_path, debug_target, "second")
    push_export(second, "me/drafter", token=TOKEN, endpoint=hub.url, revision="v1")
    assert "evaluation.json" not in hub.files("me/drafter", "v1")  # the older export's file is gone
    assert set(hub.files("me/drafter", "main")) == {".gitattributes"}  # main untouched


def test_a_store_that_loses_bytes_fails_the_verification(debug_target, tmp_path, hub):
    hub.corrupt = {"model.safetensors"}
    with pytest.raises(PushVerificationError, match=r"\['model\.safetensors'\] differ from the export"):
        push_export(_export(tmp_path, debug_target), "me/drafter", token=TOKEN, endpoint=hub.url)


def test_a_corrupt_export_is_refused_before_anything_is_sent(debug_target, tmp_path, hub):
    export = _export(tmp_path, debug_target)
    data = bytearray((export / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (export / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match the sha256"):
        push_export(export, "me/drafter", token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


def test_a_peer_export_pushes_with_its_card(debug_target, tmp_path, hub):
    peer = write_peer_export(_export(tmp_path, debug_target), tmp_path / "export-speculators", target=debug_target,
                             verifier_name_or_path="org/target")
    push_export(peer, "me/drafter-speculators", token=TOKEN, endpoint=hub.url)
    remote = hub.files("me/drafter-speculators")
    assert json.loads(remote["config.json"])["speculators_model_type"] == "dflash"
    card = remote["README.md"].decode()
    assert "base_model: org/target" in card and "vllm serve" in card and "specray_export.json" in remote


def test_cli_push(debug_target, tmp_path, hub, monkeypatch, capsys):
    export = _export(tmp_path, debug_target)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)  # read when the push runs
    assert main(["push", str(export), "--repo", "me/cli", "--token", TOKEN]) == 0
    out = capsys.readouterr().out
    assert "pushed" in out and "verified   model.safetensors" in out
    assert main(["push", str(export), "--repo", "me/cli", "--token", "wrong"]) == 2
    assert "the Hub refused the push" in capsys.readouterr().err
