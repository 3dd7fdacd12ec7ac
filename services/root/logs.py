"""Log lines that a client cannot forge: control characters in what the service logs are escaped.

Agents send free text the root logs (instance ids, exit causes, restore errors). A newline in one would
start a fake log line, an escape sequence would rewrite the operator's terminal. Rather than trusting
every call site to escape, the service's records (loggers under `services.`) have their arguments, and
their message, escaped when they are created: "\\n" is logged as the four characters `\\x0a`.
"""

from __future__ import annotations

import logging
import re
from typing import Any

# C0 and C1 controls, DEL, and the Unicode line and paragraph separators (some viewers break lines there).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_PREFIXES = ("services.",)


def escape(text: str) -> str:
    """`text` with each control character written as \\xNN (or \\uNNNN)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def _escaped(value: Any) -> Any:
    if isinstance(value, str):
        return escape(value)
    if value is None or isinstance(value, int | float):
        return value  # %d and %f keep working
    text = str(value)  # an exception or a path can carry a client's text too
    return escape(text) if _CONTROL.search(text) else value


class _Factory:
    """Wraps the record factory in place: escapes the records of the service's loggers."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record: logging.LogRecord = self.previous(*args, **kwargs)
        if record.name.startswith(_PREFIXES):
            if isinstance(record.msg, str):
                record.msg = escape(record.msg)
            if isinstance(record.args, dict):
                record.args = {key: _escaped(value) for key, value in record.args.items()}
            elif record.args:
                record.args = tuple(_escaped(value) for value in record.args)
        return record


def escape_control_characters() -> None:
    """Install the escaping (once per process; the root app calls it when it is created)."""
    factory = logging.getLogRecordFactory()
    if not isinstance(factory, _Factory):
        logging.setLogRecordFactory(_Factory(factory))
