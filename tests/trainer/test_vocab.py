"""The draft vocabulary: most frequent supervised tokens of a manifest, deterministic ties, coverage."""

import pytest
import torch

from specray.capture.contract import build_contract
from specray.capture.store import FeatureChecksumError, FeatureStore, Manifest
from specray.trainer.vocab import DraftVocabulary, draft_vocabulary, supervised_token_counts, top_tokens


def test_top_tokens_breaks_ties_by_id_and_pads_unseen_ids():
    counts = torch.zeros(10, dtype=torch.long)
    counts[[5, 9, 2, 7]] = torch.tensor([10, 10, 3, 1])
    assert top_tokens(counts, 2).tolist() == [5, 9]
    assert top_tokens(counts, 3).tolist() == [2, 5, 9]
    assert top_tokens(counts, 5).tolist() == [0, 2, 5, 7, 9]  # 0 is the smallest unseen id
    assert top_tokens(torch.tensor([0, 4]), 4).tolist() == [0, 1, 2, 3]  # ids past the counts count 0
    with pytest.raises(ValueError, match=">= 1"):
        top_tokens(counts, 0)


def _manifest(tmp_path):
    contract = build_contract("dflash", target_fingerprint="t", template_fingerprint="c", num_target_layers=8,
                              hidden_size=4)
    store = FeatureStore(str(tmp_path / "store"))
    samples = [  # (input_ids, loss_mask): only supervised tokens count
        ([1, 5, 5, 9, 9, 2], [0, 1, 1, 1, 1, 1]),
        ([1, 1, 1, 5, 9, 7, 7], [1, 0, 0, 1, 1, 1, 0]),
    ]
    refs = []
    for i, (ids, mask) in enumerate(samples):
        tensors = {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask, dtype=torch.bool),
                   "hidden_states": torch.zeros(len(ids), 4 * len(contract.layer_ids))}
        refs.append(store.put(f"s{i}.safetensors", tensors, sample_id=f"s{i}", num_tokens=len(ids),
                              contract=contract.contract_id))
    return Manifest(refs, contract, str(tmp_path / "store")), store


def test_draft_vocabulary_counts_supervised_tokens_of_a_manifest(tmp_path):
    manifest, store = _manifest(tmp_path)
    # supervised: 5 5 9 9 2 | 1 5 9 7  ->  5: 3, 9: 3, 1: 1, 2: 1, 7: 1 (9 tokens)
    assert supervised_token_counts(manifest, store).tolist() == [0, 1, 1, 0, 0, 3, 0, 1, 0, 3]
    vocab = draft_vocabulary(manifest, store, 3, source="m")
    assert vocab.token_ids == [1, 5, 9] and vocab.coverage == pytest.approx(7 / 9) and vocab.counted_tokens == 9
    wide = draft_vocabulary(manifest, store, 12, source="m")  # more ids than were ever seen (max id 9)
    assert wide.token_ids == list(range(12)) and wide.coverage == 1.0
    vocab.save(tmp_path / "v.json")
    assert DraftVocabulary.load(tmp_path / "v.json") == vocab
    blob = tmp_path / "store" / manifest.refs[0].key
    data = blob.read_bytes()
    blob.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    with pytest.raises(FeatureChecksumError):  # counted through store.get: a corrupt blob is not counted
        draft_vocabulary(manifest, store, 3, source="m")
