"""The framework callbacks' plumbing (worker_lib/integrations): `import worker_lib` never loads Lightning
or transformers, and the framework checkpoint dictionaries' odd values survive a save and restore.
(The callbacks themselves: tests/e2e/test_lightning_callback.py and test_hf_callback.py.)"""

from __future__ import annotations

import collections
import enum
import subprocess
import sys
from pathlib import Path

import torch

from tests.unit.worker_lib.helpers import assert_bit_equal
from worker_lib import Checkpointer
from worker_lib.integrations._state import PICKLED, decode, encode


def test_importing_worker_lib_loads_no_framework() -> None:
    code = (
        "import sys, worker_lib, worker_lib.integrations\n"
        "worker_lib.Checkpointer\n"
        "frameworks = ('lightning', 'pytorch_lightning', 'transformers', 'accelerate')\n"
        "loaded = [m for m in frameworks if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class Kind(enum.Enum):
    SMALL = 1


Point = collections.namedtuple("Point", "x y")


def test_values_checkpointer_save_refuses_come_back_through_pickles(shm_dir: Path) -> None:
    weights = torch.arange(6.0).reshape(2, 3)
    state = {
        "tensor": weights,
        "plain": [1, 2.5, "a", None, b"x", (True, 3)],
        "ordered": collections.OrderedDict(a=weights),
        "enum": Kind.SMALL,
        "namedtuple": Point(1, 2),
        "tuple_keys": {(1, 2): "pair"},
        "set": {3, 4},
    }
    encoded = encode(state)
    assert encoded["tensor"] is weights and encoded["ordered"]["a"] is weights, "tensors are never pickled"
    assert PICKLED in encoded["enum"] and PICKLED in encoded["tuple_keys"]
    with Checkpointer(shm_dir, blocking=True) as checkpointer:
        checkpointer.save(3, encoded)
        restored = checkpointer.restore()
    assert restored is not None
    back = decode(restored.state)
    assert_bit_equal(back["tensor"], weights)
    assert_bit_equal(back["ordered"]["a"], weights)
    assert back["plain"] == [1, 2.5, "a", None, b"x", (True, 3)]
    assert back["enum"] is Kind.SMALL
    assert back["namedtuple"] == Point(1, 2) and type(back["namedtuple"]) is Point
    assert back["tuple_keys"] == {(1, 2): "pair"}
    assert back["set"] == {3, 4}
