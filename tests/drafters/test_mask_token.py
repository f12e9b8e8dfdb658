"""The DFlash family's MASK token: chosen from the tokenizer (never a silent id 0), recorded in every export,
and an export with id 0 that does not record its choice refused at load."""

import json
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specray.drafters import dflash, dflash2, dspark
from specray.drafters.dflash import DFlashConfig, DFlashSection, choose_mask_token
from specray.drafters.format import InvalidDrafterError, load_drafter, save_drafter


def _tokenizer(text_tokens: list[str], specials: list[str], **roles) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: ``text_tokens`` (ids 0 …), then ``specials`` as added special tokens."""
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(text_tokens)}, unk_token=roles.get("unk_token")))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **roles)


TEXT = ["!", "a", "b", "c"]  # id 0 is '!', as in Llama-3's and Qwen3's vocabularies


def test_qwen3_like_tokenizer_gets_the_first_row_past_its_vocabulary():
    tok = _tokenizer(TEXT, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
                     eos_token="<|im_end|>", pad_token="<|endoftext|>")
    assert len(tok) == 9
    assert choose_mask_token(tok, vocab_size=16) == (9, "unused_embedding_row")  # Qwen3: 151669 of 151936 rows


def test_llama3_like_tokenizer_gets_its_first_reserved_special_token():
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|reserved_special_token_1|>", "<|eot_id|>"]
    tok = _tokenizer(TEXT, specials, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert choose_mask_token(tok, vocab_size=len(tok)) == (6, "reserved_special_token")  # Llama-3: 128002


def test_mask_token_then_unk_token_and_otherwise_a_refusal_naming_the_setting():
    tok = _tokenizer(TEXT, ["<s>", "</s>", "<mask>", "<unk>"], bos_token="<s>", eos_token="</s>", mask_token="<mask>",
                     unk_token="<unk>")
    assert choose_mask_token(tok, vocab_size=len(tok)) == (6, "tokenizer.mask_token")
    tok = _tokenizer(TEXT, ["<unk>", "<s>", "</s>"], bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert choose_mask_token(tok, vocab_size=len(tok)) == (4, "tokenizer.unk_token")
    tok = _tokenizer(TEXT, ["<s>", "</s>"], bos_token="<s>", eos_token="</s>", unk_token="</s>")  # unk is the eos
    with pytest.raises(ValueError, match="set drafter.mask_token_id"):
        choose_mask_token(tok, vocab_size=len(tok))


def test_debug_and_embedded_targets_keep_their_unk_token(debug_target):
    """The debug target's (and SmolLM2's) <|endoftext|> is a special token no ChatML text renders: id 0
    by name, so their drafters and golden losses are what they were."""
    assert debug_target.tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>"
    assert choose_mask_token(debug_target.tokenizer, debug_target.vocab_size) == (0, "tokenizer.unk_token")
    for module in (dflash, dspark, dflash2):
        cfg = module.debug_config(debug_target)
        assert (cfg.mask_token_id, cfg.mask_token_origin) == (0, "tokenizer.unk_token")


@pytest.mark.slow
def test_smollm2_keeps_its_unk_token(smollm2):
    assert smollm2.tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>"
    assert choose_mask_token(smollm2.tokenizer, smollm2.vocab_size) == (0, "tokenizer.unk_token")


def test_a_set_mask_token_is_used_as_set_zero_included(debug_target):
    cfg = DFlashSection(mask_token_id=0).drafter_config(debug_target, (1, 2))
    assert (cfg.mask_token_id, cfg.mask_token_origin) == (0, "drafter.mask_token_id")
    target = SimpleNamespace(tokenizer=_tokenizer(TEXT, ["<s>"], eos_token="<s>"), vocab_size=5,
                             hidden_size=debug_target.hidden_size, model=debug_target.model)
    with pytest.raises(ValueError, match="set drafter.mask_token_id"):
        DFlashSection().drafter_config(target, (1, 2))
    assert DFlashSection(mask_token_id=3).drafter_config(target, (1, 2)).mask_token_id == 3


def _export(tmp_path, target, cfg) -> str:
    model = dflash.DFlashDrafter(cfg, embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head)
    contract = {"target_fingerprint": target.target_fingerprint, "template_fingerprint": target.template_fingerprint}
    return str(save_drafter(tmp_path / "export", model, contract=contract, provenance={"run": "test"}))


def _load(target, path):
    return load_drafter(path, embed_tokens=target.model.model.embed_tokens, lm_head=target.model.lm_head,
                        target_fingerprint=target.target_fingerprint, template_fingerprint=target.template_fingerprint)


def test_every_export_records_its_mask_and_an_unrecorded_id_0_is_refused(debug_target, tmp_path):
    out = _export(tmp_path, debug_target, dflash.debug_config(debug_target))
    config_path = tmp_path / "export" / "config.json"
    arch = json.loads(config_path.read_text())["architecture"]
    assert (arch["mask_token_id"], arch["mask_token_origin"]) == (0, "tokenizer.unk_token")
    assert _load(debug_target, out).config.mask_token_origin == "tokenizer.unk_token"
    config = json.loads(config_path.read_text())
    del config["architecture"]["mask_token_origin"]  # as written before the choice was recorded
    config_path.write_text(json.dumps(config))
    with pytest.raises(InvalidDrafterError, match=r"mask_token_id is 0 and the config does not record how it was "
                                                  r"chosen.*drafter.mask_token_id"):
        _load(debug_target, out)
    config["architecture"]["mask_token_id"] = 5  # a non-zero id came from a mask or unk token: still served
    config_path.write_text(json.dumps(config))
    assert _load(debug_target, out).config.mask_token_origin == "unrecorded"


def test_mask_origin_is_checked_and_round_trips():
    cfg = DFlashConfig(hidden_size=8, vocab_size=10, target_layer_ids=(1,), mask_token_id=0)
    assert cfg.mask_token_origin == "config" and DFlashConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="mask_token_origin must be one of"):
        DFlashConfig(hidden_size=8, vocab_size=10, target_layer_ids=(1,), mask_token_id=0, mask_token_origin="x")
