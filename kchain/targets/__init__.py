"""Import rule: kchain.local and the folders below it, kchain.common and kchain.errors; SkyPilot only in skycheck.py, run apart.

Targets other than Kaggle: the same job rendered for SkyPilot managed jobs or a Slurm cluster.

A target is a renderer over the job, not a second chain engine: the engine (SkyPilot, Slurm) runs,
recovers and requeues; kchain renders the work folder, gates the push on a smoke pass, and wraps
the engine's own commands. Nothing here imports SkyPilot: `skypilot.check_task` runs skycheck.py in
a Python that has it. docs/targets.md is the user's page.
"""
