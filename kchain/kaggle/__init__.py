"""Import rule: kchain.store, kchain.common and kchain.errors (the official client only in client.py).

The Kaggle adapter: the one importer of the official client (client.py), the credential's whereabouts, and
Kaggle's datasets and models as kchain uses them.
"""
