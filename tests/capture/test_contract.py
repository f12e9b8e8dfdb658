import pytest

from specray.capture.contract import (
    CONTRACT_SPECS,
    CaptureContract,
    ContractMismatchError,
    build_contract,
    eagle3_layer_ids,
    spread_layer_ids,
)


def _contract(algorithm="dflash", **kw):
    args = dict(target_fingerprint="sha256:t", template_fingerprint="sha256:c", num_target_layers=30, hidden_size=576)
    args.update(kw)
    return build_contract(algorithm, **args)


def test_all_four_algorithms_declared():
    assert set(CONTRACT_SPECS) == {"eagle3", "dflash", "dspark", "dflash2"}


def test_default_layer_ids_for_a_30_layer_target():
    assert eagle3_layer_ids(30) == (1, 14, 26)  # outputs of [1, L//2-1, L-4]
    assert spread_layer_ids(30) == (1, 8, 14, 21, 27)
    assert spread_layer_ids(8) == (1, 2, 3, 4, 5)
    assert spread_layer_ids(5) == (1, 2)


def test_contract_fields_per_algorithm():
    eagle3 = _contract("eagle3")
    assert eagle3.layer_ids == (1, 14, 26) and eagle3.last_hidden
    assert _contract("dspark").last_hidden
    assert not _contract("dflash").last_hidden and not _contract("dflash2").last_hidden


def test_min_bytes_per_token_is_the_raw_payload():
    # 5 layers x 576 x bf16 + int32 token + bool mask
    assert _contract("dflash").min_bytes_per_token == 5 * 576 * 2 + 4 + 1
    # eagle3 adds the final-norm hidden state; float32 doubles the feature bytes
    assert _contract("eagle3", dtype="float32").min_bytes_per_token == (3 * 576 + 576) * 4 + 4 + 1


def test_layer_order_is_part_of_the_contract():
    a = _contract(layer_ids=[1, 14, 26])
    b = _contract(layer_ids=[26, 14, 1])
    assert a.contract_id != b.contract_id
    with pytest.raises(ContractMismatchError, match="layer_ids"):
        a.check_compatible(b)
    a.check_compatible(_contract(layer_ids=[1, 14, 26]))


def test_json_round_trip():
    c = _contract("eagle3")
    assert CaptureContract.from_json(c.to_json()) == c


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(layer_ids=[1, 30]), r"\[30\] out of range.*0\.\.29"),
        (dict(layer_ids=[-1]), "out of range"),
        (dict(layer_ids=[3, 3]), "repeats a layer"),
        (dict(layer_ids=[]), "empty"),
        (dict(dtype="int8"), "unknown storage dtype"),
    ],
)
def test_bad_capture_requests(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _contract(**kwargs)


def test_eagle3_needs_three_layers_and_unknown_algorithm_lists_valid():
    with pytest.raises(ValueError, match="exactly 3"):
        _contract("eagle3", layer_ids=[1, 2])
    with pytest.raises(ValueError, match=r"valid algorithms: \['dflash', 'dflash2', 'dspark', 'eagle3'\]"):
        _contract("medusa")
