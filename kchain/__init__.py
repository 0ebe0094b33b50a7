"""Import rule: anything but kchain.runtime (the laptop names it only to start it); no torch at module level.

kchain: train on free, session-limited GPUs without losing the run or the week. At the top, cli.py (the
commands, thin) and errors.py (kchain's errors and exit codes). The laptop's folders, each importing only the
ones before it: store/ (the records), kaggle/ (the adapter), job/ (spec, notebook, render), chain/ (push,
continue, the session records), result/ (pull, release, sync, plot), local/ (executor, smoke, rehearse, the
verdict), targets/ (SkyPilot, Slurm). emulator/ is the local Kaggle; common/ is shared with the kernel;
runtime/ is the training process.
"""

__version__ = "0.5.0.dev0"
