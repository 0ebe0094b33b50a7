"""Import rule: as kchain.runtime, and each framework (transformers, lightning, tensorboard) inside functions only.

The bridges to the frameworks a user's training code already uses.
"""
