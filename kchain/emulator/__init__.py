"""A local Kaggle: the unmodified `kaggle` client talks to it over HTTP; pushed notebooks run as
local sessions with Kaggle's limits. See app.Emulator for the Python API."""

from kchain.emulator.app import Emulator, serve
from kchain.emulator.faults import Faults

__all__ = ["Emulator", "Faults", "serve"]
