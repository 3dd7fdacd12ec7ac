"""What a framework puts in its checkpoint dictionaries, made storable by `Checkpointer.save()`.

Frameworks put arbitrary Python objects beside the tensors (hyper-parameters, a namedtuple, an enum, a
dict with tuple keys). `Checkpointer.save()` stores tensors, modules, optimizers and plain values in dicts,
lists and tuples; anything else is pickled here into a small tagged dict (bytes) and unpickled on the way
back. Tensors are never pickled: they stay where the store copies them without serialising.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

PICKLED = "__castor_pickled__"
_PLAIN = (bool, int, float, str, bytes, type(None))


def encode(value: Any) -> Any:
    """`value` with every part `Checkpointer.save()` does not take replaced by its pickle."""
    if isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
        return value
    if type(value) in _PLAIN:
        return value
    if isinstance(value, dict) and all(type(key) in _PLAIN for key in value) and PICKLED not in value:
        return {key: encode(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(encode(item) for item in value)
    return {PICKLED: pickle.dumps(value)}


def decode(value: Any) -> Any:
    """The inverse of `encode` on a restored state (pickles come from this rank's own checkpoint)."""
    if isinstance(value, dict):
        if len(value) == 1 and PICKLED in value:
            return pickle.loads(value[PICKLED])
        return {key: decode(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(decode(item) for item in value)
    return value
