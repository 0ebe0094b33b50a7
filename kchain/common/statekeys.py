"""How the untracked state is named in a checkpoint's digests.json, for the runtime that writes it
(runtime/checkpoint/untracked.py) and the laptop's judge that reads it (statecheck.py).

`untracked.<name>.<leaf>`: the digest of an object the job did not hand to run.track, its name as the
code writes it (`self.ema`, `gens[0]`) with its dots as `/`, so the key's own dots still separate the
leaves; `excluded.<name>`: the reason an object was left out on purpose (run.untrack). Standard library only.
"""

from __future__ import annotations

import re

UNTRACKED = "untracked"
EXCLUDED = "excluded"


def written(code_name: str) -> str:
    """`self.ema` -> `self/ema`: a name as a digest key holds it."""
    return code_name.replace(".", "/")


def code_name(key_part: str) -> str:
    """`self/ema` -> `self.ema`: a digest key's name as the code writes it."""
    return key_part.replace("/", ".")


def track_key(name: str) -> str:
    """The run.track keyword for an object the code names so: its last part that is an identifier
    (`self.ema` -> ema, `gens[0]` -> gens, `state['ema']` -> ema)."""
    for part in reversed(re.split(r"[.\[\]'\"]+", name)):
        if part.isidentifier():
            return part
    return "state"
