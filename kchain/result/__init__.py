"""Import rule: kchain.chain and the folders below it, kchain.common and kchain.errors; no torch at module level.

The result brought home: the traces, the plot, pull, release and the tracker sync.
"""
