"""Import rule: the standard library and kchain.common only (the official kaggle client inside functions).

The records and rules both sides load: the laptop, the kernel's publisher and the training process (names
and layout, the config and settings, the summary, checkpoint files, the state folder and sink, the decision
table, the exactly-once sender, the publisher). It travels in every kernel's payload beside kchain.runtime.
"""
