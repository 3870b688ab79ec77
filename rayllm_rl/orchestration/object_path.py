"""`"package.module:name"` strings in a config (e.g. `rollout.agent`) -> the object they name.

Its own module so the job config (which checks the path) and the factories (which call the
object) both import it without importing each other.
"""
from __future__ import annotations

import importlib


def import_object(path: str):
    """`"package.module:name"` -> the object; ValueError naming the path if it is malformed or missing."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"expected 'package.module:function', got {path!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {path!r}: {exc}") from exc
