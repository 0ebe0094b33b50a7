"""Import rule: as kchain.runtime (the standard library, numpy, torch, kchain.common, kchain.runtime).

Checkpoints with torch: what a save holds and when (checkpointer), the host snapshot, the write and the
verified load (state), every value's digest, a fine-tune's frozen base, the smoke's untracked-state watch.
The files on disk without torch are kchain.common.checkpoint_files.
"""
