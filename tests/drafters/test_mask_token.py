"""The DFlash family's MASK token: chosen from the tokenizer and never id 0 unless set (drafter.mask_token_id),
recorded in every export, and an export with id 0 that does not record its choice refused at load."""

import json
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

from specray.capture.target import CHATML_TEMPLATE, DEFAULT_TARGET, resolve_target_dir
from specray.drafters import dflash, dflash2, dspark
from specray.drafters.dflash import DFlashConfig, DFlashSection, choose_mask_token
from specray.drafters.format import InvalidDrafterError, load_drafter, save_drafter


def _tokenizer(tokens: list[str], specials: list[str], **roles) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over ``tokens`` (ids in list order), ``specials`` of them (or after them) added
    as special tokens; ``chat_template`` among ``roles`` is set as the template."""
    template = roles.pop("chat_template", None)
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=roles.get("unk_token")))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **roles)
    tokenizer.chat_template = template
    return tokenizer


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


def test_the_tokenizers_mask_token_comes_first():
    tok = _tokenizer(TEXT, ["<s>", "</s>", "<mask>", "<unk>"], bos_token="<s>", eos_token="</s>", mask_token="<mask>",
                     unk_token="<unk>")
    assert choose_mask_token(tok, vocab_size=len(tok)) == (6, "tokenizer.mask_token")


def test_a_special_token_with_no_role_that_the_template_never_writes():
    """SmolLM2's layout: <|endoftext|> (id 0, the unk token), ChatML's two tokens, then unused specials."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>", *TEXT]
    tok = _tokenizer(tokens, tokens[:5], bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>",
                     chat_template=CHATML_TEMPLATE)
    assert choose_mask_token(tok, vocab_size=len(tok)) == (3, "unrendered_special_token")
    written = CHATML_TEMPLATE + "{{ '<repo_name>' }}"  # a template that writes it: the next one
    tok.chat_template = {"default": CHATML_TEMPLATE, "tool_use": written}
    assert choose_mask_token(tok, vocab_size=len(tok)) == (4, "unrendered_special_token")


def test_a_byte_token_no_utf8_text_holds():
    """Byte fallback (Llama-2's ``<0xC0>``) and a byte-level BPE's character for the byte; a word-level
    vocabulary's 'À' is a letter, not a byte."""
    tokens = ["<unk>", "<s>", "</s>", "<0x41>", "<0xC0>", "<0xFF>", *TEXT]
    tok = _tokenizer(tokens, tokens[:3], bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    assert choose_mask_token(tok, vocab_size=len(tok)) == (4, "unused_byte_token")
    tok = _tokenizer(["<unk>", "<s>", "</s>", "À", *TEXT], ["<unk>", "<s>", "</s>"], bos_token="<s>", eos_token="</s>",
                     unk_token="<unk>")
    with pytest.raises(ValueError, match="set drafter.mask_token_id"):
        choose_mask_token(tok, vocab_size=len(tok))


def test_id_0_is_never_chosen_automatically():
    """Every rule skips id 0: a tokenizer whose only candidate is id 0 (its mask token, or its one special
    token with no role) is refused with the field that sets it; so is one whose only spare is its unk token."""
    for specials, roles in ((["<mask>", "<s>"], dict(mask_token="<mask>", eos_token="<s>")),
                            (["<|endoftext|>", "<s>"], dict(eos_token="<s>")),
                            (["<unk>", "<s>", "</s>"], dict(unk_token="<unk>", bos_token="<s>", eos_token="</s>"))):
        tok = _tokenizer([*specials, *TEXT], specials, **roles)
        with pytest.raises(ValueError, match=r"set drafter\.mask_token_id .*id 0 only if"):
            choose_mask_token(tok, vocab_size=len(tok))


def test_debug_and_embedded_targets_get_a_non_zero_mask(debug_target):
    """The debug target's only special token with no role is <|endoftext|>, id 0 (its unk token): its MASK
    is the token of byte 0xC0. SmolLM2's is <repo_name>, a StarCoder special ChatML never writes."""
    assert choose_mask_token(debug_target.tokenizer, debug_target.vocab_size) == (195, "unused_byte_token")
    assert debug_target.tokenizer.convert_ids_to_tokens(195) == "À"
    for module in (dflash, dspark, dflash2):
        cfg = module.debug_config(debug_target)
        assert (cfg.mask_token_id, cfg.mask_token_origin) == (195, "unused_byte_token")
    path = resolve_target_dir(DEFAULT_TARGET)
    smollm2 = AutoTokenizer.from_pretrained(path)
    assert choose_mask_token(smollm2, AutoConfig.from_pretrained(path).vocab_size) == (3, "unrendered_special_token")
    assert smollm2.convert_ids_to_tokens(3) == "<repo_name>"


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
    assert (arch["mask_token_id"], arch["mask_token_origin"]) == (195, "unused_byte_token")
    assert _load(debug_target, out).config.mask_token_origin == "unused_byte_token"
    config = json.loads(config_path.read_text())
    config["architecture"].update(mask_token_id=0, mask_token_origin="drafter.mask_token_id")  # set by the user
    config_path.write_text(json.dumps(config))
    assert _load(debug_target, out).config.mask_token_id == 0
    config["architecture"]["mask_token_origin"] = "tokenizer.unk_token"  # id 0 chosen as the unk token: as saved
    config_path.write_text(json.dumps(config))
    assert _load(debug_target, out).config.mask_token_origin == "tokenizer.unk_token"
    del config["architecture"]["mask_token_origin"]  # a config that does not record its choice
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


def test_an_unset_mask_adopts_the_init_from_exports(debug_target, tmp_path):
    """Fine-tuning keeps the MASK the export was trained with, id 0 included; a MASK set to another
    id is refused when the weights load (the architecture check, tests/trainer/test_imported_drafters.py)."""
    export = _export(tmp_path, debug_target, DFlashSection(mask_token_id=0).drafter_config(debug_target, (1, 2)))
    adopted = DFlashSection(init_from=export).drafter_config(debug_target, (1, 2))
    assert (adopted.mask_token_id, adopted.mask_token_origin) == (0, "drafter.init_from")
    assert DFlashSection(init_from=export, mask_token_id=7).drafter_config(debug_target, (1, 2)).mask_token_id == 7
    fresh = DFlashSection().drafter_config(debug_target, (1, 2))
    assert (fresh.mask_token_id, fresh.mask_token_origin) == (195, "unused_byte_token")
