"""kchain: train on free, session-limited GPUs without losing the run or the week."""

__version__ = "0.1.0"
