"""Checkpointer round trips: every dtype, odd shapes and strides, aliasing, modules and optimizers."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.unit.worker_lib.helpers import assert_bit_equal, forkserver, raw_bytes
from worker_lib import CheckpointCorruptError, Checkpointer, load_state
from worker_lib.store.slots import SlotStore


def cpu_dtypes() -> list[torch.dtype]:
    """Every dtype torch can hold in a dense CPU tensor (quantized dtypes need quantized tensors)."""
    found = []
    for dtype in sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str):
        if str(dtype).startswith(("torch.qint", "torch.quint")):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
                torch.empty(2, dtype=dtype).view(torch.uint8)
        except (RuntimeError, TypeError):
            continue
        found.append(dtype)
    return found


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bytes of `dtype` (valid 0/1 for bool), NaN patterns included for floats."""
    tensor = torch.empty(shape, dtype=dtype)
    high = 2 if dtype == torch.bool else 256
    raw = tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor.view(torch.uint8)
    raw.copy_(torch.randint(0, high, raw.shape, dtype=torch.uint8, generator=generator))
    return tensor


def dtype_state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {}
    for dtype in cpu_dtypes():
        name = str(dtype).removeprefix("torch.")
        state[name] = {
            "matrix": random_tensor((5, 7), dtype, generator),
            "scalar": random_tensor((), dtype, generator),
            "empty": random_tensor((0, 3), dtype, generator),
            "strided": random_tensor((6, 8), dtype, generator)[1:, ::3],  # only this view is in the state
            "transposed": random_tensor((4, 3), dtype, generator).t(),
        }
    return state


def test_the_dtype_list_covers_the_interesting_ones() -> None:
    names = {str(dtype).removeprefix("torch.") for dtype in cpu_dtypes()}
    assert {"bfloat16", "float16", "float64", "bool", "complex64", "complex128", "float8_e4m3fn"} <= names
    assert {"uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64"} <= names


@pytest.mark.parametrize("blocking", [True, False])
def test_every_dtype_shape_and_stride_round_trips_bit_exact(shm_dir: Path, blocking: bool) -> None:
    state = dtype_state()
    with Checkpointer(shm_dir, blocking=blocking) as checkpointer:
        assert checkpointer.save(1, state)
        restored = checkpointer.restore()
    assert restored is not None and restored.iteration == 1
    assert_bit_equal(restored.state, state)
    assert restored.state["float32"]["strided"].is_contiguous()  # views come back as plain tensors


def test_restore_into_existing_tensors_of_any_layout(shm_dir: Path) -> None:
    state = dtype_state()
    generator = torch.Generator().manual_seed(1)
    targets = {
        name: {
            "matrix": torch.empty(5, 7, dtype=values["matrix"].dtype),
            "scalar": torch.empty((), dtype=values["scalar"].dtype),
            "empty": torch.empty(0, 3, dtype=values["empty"].dtype),
            "strided": random_tensor((5, 6), values["strided"].dtype, generator)[:, ::2],  # strided target
            "transposed": torch.empty(4, 3, dtype=values["transposed"].dtype).t(),
        }
        for name, values in state.items()
    }
    before = {name: {key: t.data_ptr() for key, t in values.items()} for name, values in targets.items()}
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, state)
        restored = checkpointer.restore(into=targets)
    assert restored is not None
    assert_bit_equal(targets, state)
    for name, values in targets.items():
        for key, tensor in values.items():
            assert tensor.data_ptr() == before[name][key]  # filled in place
            assert restored.state[name][key].data_ptr() == tensor.data_ptr()


@pytest.mark.parametrize("blocking", [True, False])
def test_a_save_reads_the_tensors_it_is_given_after_they_were_replaced(shm_dir: Path, blocking: bool) -> None:
    """A save reuses the previous save's copies into its slot only when every source is the same memory:
    tensors replaced by others of the same dtype, shape and strides (the same layout), e.g. a parameter's
    `.data` swapped or an optimizer state rebuilt, are read from their new memory."""
    generator = torch.Generator().manual_seed(2)
    model = nn.Linear(64, 32)
    spans = random_tensor((8, 40), torch.float32, generator)
    state: dict[str, Any] = {
        "model": model,
        "plain": torch.arange(1000.0),
        "span": spans[:, :5],
        "tied": spans,
    }
    with Checkpointer(shm_dir, slots=2, blocking=blocking) as checkpointer:
        for iteration in range(1, 7):
            if iteration > 2:  # every slot was written once: from here on the layout is the same
                with torch.no_grad():
                    model.weight.data = random_tensor((32, 64), torch.float32, generator)
                    model.bias.add_(1.0)  # in place: the same memory, new values
                state["plain"] = random_tensor((1000,), torch.float32, generator)
                spans = random_tensor((8, 40), torch.float32, generator)
                state["span"], state["tied"] = spans[:, :5], spans
            checkpointer.save(iteration, state)
            checkpointer.wait()
            restored = checkpointer.restore()
            assert restored is not None and restored.iteration == iteration
            expected = {**state, "model": model.state_dict()}
            assert_bit_equal(restored.state, expected)


def test_restore_across_stripes_into_strided_and_other_dtype_targets(shm_dir: Path) -> None:
    # 12 MB matrices saved contiguous: stripe boundaries (2 MiB) fall inside 4000-byte rows, which a
    # strided target copies whole, so its two stripes are checked together before that row is copied.
    generator = torch.Generator().manual_seed(3)
    state = {
        "a": torch.randn(3000, 1000, generator=generator),
        "b": torch.randn(3000, 1000, generator=generator),
        "tied": torch.randn(600, 4000, generator=generator),
    }
    state["alias"] = state["tied"][::2]
    targets = {
        "a": torch.empty(1000, 3000).t(),  # strided
        "b": torch.empty(3000, 1000, dtype=torch.float64),  # cast on the way
        "tied": torch.empty(600, 4000),
        "alias": torch.empty(300, 4000),  # a view of a shared region, into its own tensor
    }
    with Checkpointer(shm_dir, threads=2) as checkpointer:
        checkpointer.save(1, state)
        restored = checkpointer.restore(into=targets)
        fresh = checkpointer.restore()
    assert restored is not None and fresh is not None
    assert torch.equal(targets["a"], state["a"]) and not targets["a"].is_contiguous()
    assert torch.equal(targets["b"], state["b"].double())
    assert torch.equal(targets["tied"], state["tied"]) and torch.equal(targets["alias"], state["alias"])
    assert_bit_equal(fresh.state, state)


def test_tensors_sharing_storage_are_saved_once_and_restored_sharing_it(shm_dir: Path) -> None:
    base = torch.arange(48, dtype=torch.float32)
    tied = torch.randn(1000, 64)
    state = {
        "base": base,
        "rows": base.view(6, 8)[1:4, ::2],
        "bits": base.view(torch.int32)[40:44],
        "encoder": tied,
        "decoder": tied,
    }
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, state)
        restored = checkpointer.restore()
    assert restored is not None
    assert_bit_equal(restored.state, state)
    out = restored.state
    assert out["rows"].stride() == (8, 2)
    assert out["rows"].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr()
    assert out["bits"].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr()
    assert out["encoder"].data_ptr() == out["decoder"].data_ptr()
    out["base"][8] = -1.0  # an in-place change shows through every view, as in the saved state
    assert out["rows"][0, 0].item() == -1.0
    (manifest,) = SlotStore(shm_dir).committed()
    assert manifest.data_bytes < 2 * tied.numel() * 4  # the tied weight is stored once


def test_nested_structures_and_plain_values_round_trip(shm_dir: Path) -> None:
    state = {
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0)}, 5: {}},
            "param_groups": [{"betas": (0.9, 0.99), "params": [0, 5]}],
        },
        "rng": torch.get_rng_state(),
        "values": [1, 2.5, float("nan"), float("-inf"), -0.0, None, True, "text", b"\x00\x01"],
    }
    with Checkpointer(shm_dir, blocking=True) as checkpointer:
        checkpointer.save(4, state)
        restored = checkpointer.restore()
    assert restored is not None
    assert_bit_equal(restored.state, state)


def make_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        inputs = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        model(inputs).pow(2).mean().backward()
        optimizer.step()


def train_and_save(directory: str, steps: int) -> None:
    """Child process: train, checkpoint every step, exit."""
    model, optimizer = make_model(seed=0)
    with Checkpointer(directory) as checkpointer:
        for step in range(steps):
            train(model, optimizer, range(step, step + 1))
            checkpointer.save(step, {"model": model, "optimizer": optimizer, "step": step})


def test_training_resumed_from_a_checkpoint_continues_bit_exactly(shm_dir: Path) -> None:
    reference, reference_optimizer = make_model(seed=0)
    train(reference, reference_optimizer, range(10))

    saver = forkserver().Process(target=train_and_save, args=(str(shm_dir), 5))
    saver.start()
    saver.join(120)
    assert saver.exitcode == 0

    model, optimizer = make_model(seed=1)  # different weights, no optimizer state yet
    with Checkpointer(shm_dir) as checkpointer:
        restored = checkpointer.restore(into={"model": model, "optimizer": optimizer})
    assert restored is not None and restored.iteration == 4 and restored.state["step"] == 4
    train(model, optimizer, range(restored.iteration + 1, 10))
    assert_bit_equal(model.state_dict(), reference.state_dict())
    assert_bit_equal(optimizer.state_dict(), reference_optimizer.state_dict())


def test_load_state_loads_a_restored_state_afterwards(shm_dir: Path) -> None:
    model, optimizer = make_model(seed=0)
    train(model, optimizer, range(3))
    extra = torch.zeros(3)
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(2, {"model": model, "optimizer": optimizer, "extra": torch.arange(3.0), "step": 2})
        restored = checkpointer.restore()
    assert restored is not None
    other, other_optimizer = make_model(seed=1)
    load_state(restored.state, {"model": other, "optimizer": other_optimizer, "extra": extra, "step": 0})
    assert_bit_equal(other.state_dict(), model.state_dict())
    assert_bit_equal(other_optimizer.state_dict(), optimizer.state_dict())
    assert torch.equal(extra, torch.arange(3.0))
    fresh, fresh_optimizer = make_model(seed=2)
    restored.load_into({"model": fresh, "optimizer": fresh_optimizer})
    assert_bit_equal(fresh.state_dict(), model.state_dict())


def test_a_mismatched_target_is_refused_before_anything_is_copied(shm_dir: Path) -> None:
    model, optimizer = make_model(seed=0)
    wider = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))
    untouched = [raw_bytes(t).clone() for t in wider.state_dict().values()]
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model, "optimizer": optimizer})
        with pytest.raises(
            ValueError, match=r"^state\['model'\]\['0.weight'\]: the checkpoint has a tensor of \[32, 8\]"
        ):
            checkpointer.restore(into={"model": wider})
        with pytest.raises(KeyError, match=r"state\['scheduler'\] is not in the checkpoint"):
            checkpointer.restore(into={"scheduler": torch.zeros(1)})
        with pytest.raises(KeyError, match="missing"):
            checkpointer.restore(into={"model": nn.Linear(8, 32)})
    after = [raw_bytes(t) for t in wider.state_dict().values()]
    assert all(torch.equal(a, b) for a, b in zip(after, untouched, strict=True))


def test_an_optimizer_with_other_parameter_groups_is_refused_before_the_model_is_touched(
    shm_dir: Path,
) -> None:
    """The optimizer's groups are checked with the other targets: before, its load_state_dict refused them
    only after the model had been restored, leaving the model at the checkpoint and the optimizer not."""
    model, optimizer = make_model(seed=0)
    train(model, optimizer, range(2))
    live, _ = make_model(seed=1)
    train(live, torch.optim.Adam(live.parameters()), range(1))
    decayed = [p for p in live.parameters() if p.dim() > 1]
    others = [p for p in live.parameters() if p.dim() <= 1]
    split = torch.optim.Adam([{"params": decayed, "weight_decay": 0.1}, {"params": others}], lr=1e-2)
    untouched = [raw_bytes(t).clone() for t in live.state_dict().values()]
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, {"model": model, "optimizer": optimizer})
        with pytest.raises(
            ValueError,
            match=r"^state\['optimizer'\]: the checkpoint's optimizer has 1 parameter group\(s\) of \[6\] "
            r"parameters, this one 2 of \[2, 4\]",
        ):
            checkpointer.restore(into={"model": live, "optimizer": split})
        restored = checkpointer.restore()
    assert restored is not None
    after = [raw_bytes(t) for t in live.state_dict().values()]
    assert all(torch.equal(a, b) for a, b in zip(after, untouched, strict=True))
    assert not split.state
    with pytest.raises(ValueError, match="parameter group"):
        load_state(restored.state, {"model": live, "optimizer": split})
    after = [raw_bytes(t) for t in live.state_dict().values()]
    assert all(torch.equal(a, b) for a, b in zip(after, untouched, strict=True))


class WithExtraState(nn.Module):
    """A layer with extra state, as Transformer Engine's FP8 layers keep their scaling history: returned by
    get_extra_state as a fresh tensor (`as_tensor`) or a dict, put back only by set_extra_state."""

    def __init__(self, as_tensor: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.as_tensor = as_tensor
        self.history = [1.0, 2.0]

    def get_extra_state(self) -> Any:
        return torch.tensor(self.history) if self.as_tensor else {"history": list(self.history)}

    def set_extra_state(self, state: Any) -> None:
        self.history = state.tolist() if self.as_tensor else list(state["history"])


@pytest.mark.parametrize("as_tensor", [True, False], ids=["tensor", "dict"])
def test_a_module_s_extra_state_is_restored_through_set_extra_state(shm_dir: Path, as_tensor: bool) -> None:
    """Before, restore(into=...) filled the state_dict's copy of a tensor extra state (set_extra_state was
    never called: restored in name only) and failed on a dict one with an AttributeError."""
    model = WithExtraState(as_tensor)
    weight = model.linear.weight.detach().clone()
    with Checkpointer(shm_dir) as checkpointer:
        for iteration in (1, 2):
            checkpointer.save(iteration, {"model": model})
            checkpointer.wait()
            model.history = [7.0, 9.0]
            with torch.no_grad():
                model.linear.weight.add_(1.0)
            restored = checkpointer.restore(into={"model": model})
            assert restored is not None
            assert model.history == [1.0, 2.0]
            assert torch.equal(model.linear.weight, weight)
            # The tensors are filled in place: the restored state holds no second copy of the model.
            assert restored.state["model"]["linear.weight"].data_ptr() == model.linear.weight.data_ptr()
        fresh = WithExtraState(as_tensor)
        fresh.history = [5.0]
        assert checkpointer.restore(into={"model": fresh}) is not None
    assert fresh.history == [1.0, 2.0] and torch.equal(fresh.linear.weight, weight)


def test_restores_into_the_saved_state_stay_exact_and_verified(shm_dir: Path) -> None:
    """A restore into the very state this process saved skips matching its targets one by one and, from
    the second on, reuses its copies: each still puts back exactly the saved bytes, refuses a changed
    target, and detects a corrupt byte before it reaches a target."""
    model, optimizer = make_model(seed=3)
    train(model, optimizer, range(2))
    state = {"model": model, "optimizer": optimizer}
    with Checkpointer(shm_dir, slots=2) as checkpointer:
        matched = checkpointer._matched
        shortcuts: list[bool] = []

        def spy(*args: Any) -> Any:
            found = matched(*args)
            shortcuts.append(found is not None)
            return found

        checkpointer._matched = spy  # type: ignore[method-assign]
        for iteration in range(1, 5):
            checkpointer.save(iteration, state)
            checkpointer.wait()
            saved = {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "optimizer": copy.deepcopy(optimizer.state_dict()),
            }
            for _ in range(2):  # the second restore of the same checkpoint reuses the first one's copies
                train(model, optimizer, range(10 + iteration, 11 + iteration))  # changes everything
                restored = checkpointer.restore(into=state)
                assert restored is not None and restored.iteration == iteration
                assert_bit_equal(model.state_dict(), saved["model"])
                assert_bit_equal(optimizer.state_dict(), saved["optimizer"])
        assert shortcuts == [True] * 8  # every one of them took the shortcut
        # A parameter of another shape is refused, as without the shortcut.
        weight = model[0].weight
        model[0].weight = nn.Parameter(torch.zeros(16, 8))
        with pytest.raises(ValueError, match=r"the checkpoint has a tensor of \[32, 8\]"):
            checkpointer.restore(into=state)
        model[0].weight = weight
        # A corrupt byte: detected, and not one byte of its stripe reaches the target.
        manifest = next(m for m in SlotStore(shm_dir).committed() if m.iteration == 4)
        entry = next(t for t in manifest.tensors if t.key == "state['model']['3.weight']")
        slot = next(p for p in shm_dir.glob("slot-*.json") if f'"iteration":{4},' in p.read_text())
        with open(slot.with_suffix(".bin"), "r+b") as data:
            data.seek(entry.offset + 3)
            byte = data.read(1)[0]
            data.seek(entry.offset + 3)
            data.write(bytes([byte ^ 0x01]))
        with torch.no_grad():
            model[3].weight.fill_(7.0)
        with pytest.raises(
            CheckpointCorruptError, match=r"affected tensors: .*state\['model'\]\['3.weight'\]"
        ):
            checkpointer.restore(into=state)
        assert torch.equal(model[3].weight, torch.full_like(model[3].weight, 7.0))


def _optimizer_values(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer's state_dict with every tensor cloned (step counts included) and its dtypes noted."""
    state = copy.deepcopy(optimizer.state_dict())
    state["dtypes"] = sorted({str(v.dtype) for s in optimizer.state.values() for v in s.values()})
    return state


def test_a_restore_into_the_saved_state_resumes_training_bit_exact(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore into the very state this process saved skips optimizer.load_state_dict where it would
    change nothing (torch's own optimizer, no hooks, every state tensor restored in place as it is): the
    step counts, moments and param_groups are the saved ones, and training goes on exactly as from the
    state it saved. Where load_state_dict would change something (a hook, a subclass, a state tensor of
    another dtype than its parameter's), it is called as before."""
    import worker_lib.restore as restore_module

    skipped: list[bool] = []
    decide = restore_module._load_changes_nothing
    monkeypatch.setattr(
        restore_module, "_load_changes_nothing", lambda o: skipped.append(decide(o)) or skipped[-1]
    )
    reference, reference_optimizer = make_model(seed=5)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, amsgrad=True)
    train(reference, reference_optimizer, range(3))
    at_three = (
        {k: v.clone() for k, v in reference.state_dict().items()},
        _optimizer_values(reference_optimizer),
    )
    train(reference, reference_optimizer, range(3, 6))

    model, _ = make_model(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    state = {"model": model, "optimizer": optimizer}
    with Checkpointer(shm_dir) as checkpointer:
        train(model, optimizer, range(3))
        checkpointer.save(3, state)
        train(model, optimizer, range(3, 5))  # two more steps: moments, step counts and weights move on
        restored = checkpointer.restore(into=state, iteration=3)
        assert restored is not None and skipped == [True]
        assert_bit_equal(model.state_dict(), at_three[0])
        assert_bit_equal(_optimizer_values(optimizer), at_three[1])  # step == 3 in every parameter's state
        assert restored.state["optimizer"]["state"][0]["step"].item() == 3  # decoded when read
        train(model, optimizer, range(3, 6))
        assert_bit_equal(model.state_dict(), reference.state_dict())
        assert_bit_equal(_optimizer_values(optimizer), _optimizer_values(reference_optimizer))

        # A load_state_dict post-hook (it could do anything): loaded as before, the hook runs.
        hooked: list[int] = []
        handle = optimizer.register_load_state_dict_post_hook(lambda o: hooked.append(1))
        checkpointer.save(6, state)
        train(model, optimizer, range(6, 7))
        checkpointer.restore(into=state, iteration=6)
        handle.remove()
        assert hooked == [1] and skipped[-1] is False

        # A moment held in another dtype than its parameter: load_state_dict casts it, as before.
        first = next(iter(optimizer.state.values()))
        first["exp_avg"] = first["exp_avg"].double()
        checkpointer.save(7, state)
        checkpointer.restore(into=state, iteration=7)
        assert skipped[-1] is False and first is not next(iter(optimizer.state.values()))
        assert next(iter(optimizer.state.values()))["exp_avg"].dtype == torch.float32


class _CountingAdam(torch.optim.Adam):
    loads = 0

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        type(self).loads += 1
        super().load_state_dict(state_dict)


def test_an_optimizer_that_is_not_torchs_own_is_always_loaded(shm_dir: Path) -> None:
    model, _ = make_model(seed=6)
    optimizer = _CountingAdam(model.parameters(), lr=1e-2)
    train(model, optimizer, range(2))
    state = {"model": model, "optimizer": optimizer}
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(2, state)
        saved = _optimizer_values(optimizer)
        train(model, optimizer, range(2, 3))
        checkpointer.restore(into=state, iteration=2)
    assert _CountingAdam.loads == 1
    assert_bit_equal(_optimizer_values(optimizer), saved)


def test_a_restore_into_the_saved_state_notices_a_tensor_changed_in_place(shm_dir: Path) -> None:
    """The shortcut of a restore into the saved state (and its cached copies) holds only while every
    target has the layout it was saved with: the same tensor objects at the same addresses, transposed or
    reshaped in place, take the long way, which restores them by value or refuses them."""
    square = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    other = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    state = {"square": square, "other": other}
    saved = {k: v.clone() for k, v in state.items()}
    with Checkpointer(shm_dir) as checkpointer:
        checkpointer.save(1, state)
        for _ in range(2):  # the second restore reuses the first one's copies
            restored = checkpointer.restore(into=state, iteration=1)
            assert restored is not None
        address = square.data_ptr()
        square.t_()  # the same object and bytes, its strides swapped
        square.zero_()
        restored = checkpointer.restore(into=state, iteration=1)
        assert square.data_ptr() == address and square.stride() == (1, 4)
        assert torch.equal(square, saved["square"])  # by value: element (i, j) of the saved tensor
        square.t_()
        assert_bit_equal(checkpointer.restore(into=state, iteration=1).state, saved)
        other.resize_(2, 6)  # the same storage, another shape
        with pytest.raises(ValueError, match=r"the checkpoint has a tensor of \[3, 4\], the target a tensor"):
            checkpointer.restore(into=state, iteration=1)
