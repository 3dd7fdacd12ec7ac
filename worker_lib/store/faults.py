"""Deterministic pause points for the crash-safety tests.

With `CASTOR_STORE_TEST_PAUSE_AT=<phase>` (or `<phase>@<n>`), the process stops itself with SIGSTOP the
first (n-th) time it reaches `<phase>`, so a test can SIGKILL it at exactly that instant. The variable is
read at every pause point (not at import) so a test can set it in an already running child. Phases, in the
order a save reaches them:

- `after-invalidate`: the target slot's manifest was unlinked, no byte written yet;
- `mid-copy`: half of the stripes are being copied;
- `before-rename`: the new manifest is in `slot-<k>.json.tmp`, not yet renamed;
- `after-rename`: the checkpoint is committed, the slot lock is still held.
"""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter

PAUSE_ENV = "CASTOR_STORE_TEST_PAUSE_AT"
PHASES = ("after-invalidate", "mid-copy", "before-rename", "after-rename")

_reached: Counter[str] = Counter()


def pause_point(phase: str) -> None:
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    name, _, nth = spec.partition("@")
    if name != phase:
        return
    _reached[phase] += 1
    if _reached[phase] == int(nth or 1):
        # Directed at this thread, the stop takes effect before it returns; a signal to the process could
        # be taken by another thread while this one goes on (renaming the manifest, say).
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
