"""The code that runs inside the Kaggle kernel.

It imports only the standard library, numpy and torch, because it is embedded into notebooks that
may run with the internet off. This package file stays light (no torch) so the laptop side can
import `kchain.runtime.layout` for the file-name constants.
"""
