"""Import rule: kchain.kaggle, kchain.store, kchain.common, kchain.errors (and the kernel_templates data); no torch at module level.

The job: its spec (job.yaml, with the targets' keys), the notebook's code and the packages it imports, the
rendered notebook, its attached inputs and pip wheels, `kchain init`, the failure diagnosis and the leftover
framework saves refused before a smoke.
"""
