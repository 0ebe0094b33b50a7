"""Import rule: as kchain.runtime, and each framework (transformers, accelerate, lightning, tensorboard) in functions only.

The bridges to the frameworks a user's training code already uses.
"""
