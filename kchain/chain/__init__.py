"""Import rule: kchain.job, kchain.kaggle, kchain.store, kchain.common and kchain.errors.

The chain on Kaggle: push, continue and stop (advance.py), the session records read back from Kaggle
(sessions.py), where the result is (outcome.py), the week's budget, notifications and the doctor.
"""
