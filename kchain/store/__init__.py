"""Import rule: kchain.common and kchain.errors only (no torch, numpy or kaggle).

The laptop's records: the ledger (run log, sessions, the weekly GPU ledger, smoke passes, releases) and the
names kchain gives Kaggle's kernels and datasets. The bottom of the laptop's folders: everything above reads it.
"""
