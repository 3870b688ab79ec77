"""`"package.module:name"` strings in a config (`rollout.agent`, `reward.fn`, `task`) -> the object they name.

Its own module so the job config (which checks the path) and the factories (which call the
object) both import it without importing each other.
"""
from __future__ import annotations

import importlib


def is_import_path(text: str) -> bool:
    """Whether `text` has the form 'package.module:name' (a module, a colon, a name)."""
    module, sep, name = text.partition(":")
    return bool(sep and module and name)


def import_object(path: str, key: str = ""):
    """`"package.module:name"` -> the object; ValueError naming `key` (the config key, if given), the path, and
    what is missing: the module (not on the path), a module it imports, or the attribute (listing close names)."""
    where = f"{key}={path!r}" if key else repr(path)
    module, _, name = path.partition(":")
    if not is_import_path(path):
        raise ValueError((f"{key}: " if key else "") + f"expected 'package.module:function', got {path!r}")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module == missing or module.startswith(missing + ".")):
            raise ValueError(f"cannot import {where}: No module named {missing!r} (is the folder holding it on "
                             "PYTHONPATH, or in the job's working dir?)") from exc
        raise ValueError(f"cannot import {where}: importing module {module!r} failed: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the module's own code raised while importing
        raise ValueError(f"cannot import {where}: importing module {module!r} raised "
                         f"{type(exc).__name__}: {exc}") from exc
    if not hasattr(mod, name):
        import difflib

        close = difflib.get_close_matches(name, [n for n in dir(mod) if not n.startswith("_")], n=3, cutoff=0.6)
        raise ValueError(f"cannot import {where}: module {module!r} has no attribute {name!r}"
                         + (f"; close names: {close}" if close else ""))
    return getattr(mod, name)
