"""Import rule: the standard library, psutil, kchain.common, kchain.errors and kchain.emulator only.

A local Kaggle: the unmodified `kaggle` client talks to it over HTTP; pushed notebooks run as
local sessions with Kaggle's limits. See app.Emulator for the Python API, switches.Switches for how
strict it is (strict by default) and faults.Faults for injected misbehaviour."""

from __future__ import annotations

from typing import Any

__all__ = ["Emulator", "Faults", "Switches", "serve"]
_WHERE = {"Emulator": "app", "serve": "app", "Faults": "faults", "Switches": "switches"}


def __getattr__(name: str) -> Any:
    """The public names, imported when first used: the CLI reads the switches' fields without the server."""
    if name not in _WHERE:
        raise AttributeError(f"module 'kchain.emulator' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"kchain.emulator.{_WHERE[name]}"), name)
