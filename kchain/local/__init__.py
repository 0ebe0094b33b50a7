"""Import rule: kchain.result and the folders below it, kchain.emulator, kchain.common and kchain.errors; no torch at module level.

Local execution: the notebook executor, the smoke, the rehearsal against the local Kaggle, and the verdict
(statecheck.py) that compares an interrupted run with an uninterrupted one.
"""
