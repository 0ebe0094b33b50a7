"""Import rule: the standard library, psutil, kchain.common, kchain.errors and kchain.emulator only.

A local Kaggle: the unmodified `kaggle` client talks to it over HTTP; pushed notebooks run as
local sessions with Kaggle's limits. See app.Emulator for the Python API, switches.Switches for how
strict it is (strict by default) and faults.Faults for injected misbehaviour."""

from kchain.emulator.app import Emulator, serve
from kchain.emulator.faults import Faults
from kchain.emulator.switches import Switches

__all__ = ["Emulator", "Faults", "Switches", "serve"]
