"""The state tree codec: exact round trips of plain values and structure, and TypeErrors naming the path."""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch
from torch import nn

from tests.unit.worker_lib.helpers import assert_bit_equal
from worker_lib.store.tree import FlatState, FlattenMemo, flatten, tree_json, unflatten

PLAIN_STATE = {
    "step": 7,
    "big": 2**80,
    "lr": 0.1,
    "ratio": 1.0,
    "zero": -0.0,
    "nan": float("nan"),
    "inf": float("inf"),
    "minus_inf": float("-inf"),
    "name": "run/κ",
    "flags": [True, False, None],
    "betas": (0.9, 0.999),
    "nested": {"list": [1, [2, (3,)]], "empty": {}, "tuple": ()},
    "blob": b"\x00\xffbytes",
    3: "int key",
    2.5: "float key",
    None: "none key",
    True: "bool key",
    "1": "string key that looks like an int",
}


def round_trip(state: object) -> object:
    flat = flatten(state)
    tree = json.loads(json.dumps(flat.tree, allow_nan=False))  # what the manifest stores
    return unflatten(tree, flat.tensors.__getitem__)


def test_plain_values_and_structure_round_trip_exactly() -> None:
    restored = round_trip(PLAIN_STATE)
    assert_bit_equal(restored, PLAIN_STATE)
    assert (
        isinstance(restored, dict) and type(restored["betas"]) is tuple and type(restored["ratio"]) is float
    )
    assert list(restored) == list(PLAIN_STATE)  # key order kept


def test_tensors_are_referenced_by_index_in_order() -> None:
    a, b = torch.zeros(2), torch.ones(3)
    flat = flatten({"x": [a, {"y": b}], "z": a})
    assert flat.keys == ["state['x'][0]", "state['x'][1]['y']", "state['z']"]
    assert [t is s for t, s in zip(flat.tensors, [a, b, a], strict=True)] == [True, True, True]


def test_a_state_dict_keeps_its_metadata() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    state_dict = model.state_dict()
    restored = round_trip(state_dict)
    assert isinstance(restored, OrderedDict)
    assert restored._metadata == state_dict._metadata  # type: ignore[attr-defined]


def test_modules_and_optimizers_are_saved_as_their_state_dicts() -> None:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    flat = flatten({"model": model, "optimizer": optimizer})
    assert flat.modules == [model]
    assert (
        flat.tree is not None and "module" in json.dumps(flat.tree) and "optimizer" in json.dumps(flat.tree)
    )
    restored = unflatten(flat.tree, flat.tensors.__getitem__)
    assert list(restored["model"]) == ["weight", "bias"]
    assert restored["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)


class Foo:
    pass


UNSUPPORTED = {
    "object": (
        lambda: {"optimizer": {"state": {3: {"foo": Foo()}}}},
        r"^state\['optimizer'\]\['state'\]\[3\]\['foo'\]: unsupported type Foo$",
    ),
    "sparse": (
        lambda: {"x": [1, {"y": torch.eye(3).to_sparse()}]},
        r"^state\['x'\]\[1\]\['y'\]: unsupported tensor: torch\.sparse_coo",
    ),
    "quantized": (
        lambda: {"q": torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)},
        r"^state\['q'\]: .*quantized",
    ),
    "nested": (
        lambda: {"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])},
        r"^state\['n'\]: .*nested",
    ),
    "meta": (lambda: {"m": torch.empty(2, device="meta")}, r"^state\['m'\]: .*meta"),
    "key": (lambda: {(1, 2): 3}, r"^state: unsupported dict key type tuple"),
    "numpy": (lambda: {"f": torch.ones(1).numpy()[0]}, r"^state\['f'\]: unsupported type float32"),
    "set": (lambda: {"s": {1, 2}}, r"^state\['s'\]: unsupported type set"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", UNSUPPORTED)
def test_unsupported_values_raise_a_type_error_naming_the_key_path(kind: str) -> None:
    make_state, message = UNSUPPORTED[kind]
    with pytest.raises(TypeError, match=message):
        flatten(make_state())


def test_a_reference_cycle_is_refused() -> None:
    state: dict[str, object] = {}
    state["self"] = [state]
    with pytest.raises(TypeError, match=r"state\['self'\]\[0\]: the state contains itself"):
        flatten(state)


def test_a_memo_reuses_only_the_tensor_dicts_that_did_not_change() -> None:
    """flatten with a memo gives exactly what flatten without one gives (the tree's JSON, the tensors by
    identity of their memory), whatever changed between calls; unchanged tensor dicts keep their nodes."""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    state = {"model": model, "optimizer": optimizer, "extra": {"a": torch.ones(2)}}
    memo = FlattenMemo()

    def check() -> FlatState:
        plain, memoised = flatten(state), flatten(state, memo)
        assert tree_json(memoised.tree, memo) == json.dumps(plain.tree, separators=(",", ":"))
        assert memoised.keys == plain.keys
        assert [t.data_ptr() for t in memoised.tensors] == [t.data_ptr() for t in plain.tensors]
        assert all(not t.requires_grad for t in memoised.tensors)
        return memoised

    first = check()
    again = check()
    module_node = again.tree["dict"][0][1]["module"]  # type: ignore[call-overload,index]
    assert module_node is first.tree["dict"][0][1]["module"]  # type: ignore[call-overload,index]
    with torch.no_grad():
        model[0].weight.data = torch.randn(3, 4)  # the same Parameter, another storage
    replaced = check()
    assert replaced.tensors[0].data_ptr() == model[0].weight.data_ptr()
    optimizer.param_groups[0]["lr"] = 1  # an int now: JSON tells 1 from 0.1 and from 1.0
    check()
    optimizer.state[model[0].bias]["exp_avg"] = torch.zeros(3)  # a new tensor in a per-parameter dict
    check()
    optimizer.load_state_dict(optimizer.state_dict())  # new per-parameter dicts around the same tensors
    check()
    model[1].register_buffer("extra", torch.ones(1))  # a key more
    check()
    state["extra"]["a"] = torch.zeros(2)  # type: ignore[index]
    check()
    del state["extra"]
    check()
    model[0].bias.requires_grad_(False)  # frozen: saved as it is, no longer detached
    check()
    optimizer.state[model[0].weight]["max_exp_avg_sq"] = torch.zeros(3, 4)  # a key more in one of them
    check()
    optimizer.param_groups[0]["params"].append(99)  # the ids of a group, encoded as they are
    check()
    # The same Parameter object, now on the meta device: the memo's checks see it, not only the types.
    torch.utils.swap_tensors(model[0].weight, nn.Parameter(torch.empty(3, 4, device="meta")))
    with pytest.raises(TypeError, match=r"^state\['model'\]\['0.weight'\]: .*meta"):
        flatten(state, memo)
