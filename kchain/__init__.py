"""Import rule: anything but kchain.runtime (the laptop names it only to start it); no torch at module level.

kchain: train on free, session-limited GPUs without losing the run or the week. The modules here run on the
laptop (the CLI, the job spec, the Kaggle client, the chain); kchain.common is shared with the kernel,
kchain.runtime is the training process, kchain.targets and kchain.emulator are laptop packages.
"""

__version__ = "0.1.0"
