"""Import rule: the standard library, numpy, torch, kchain.common and kchain.runtime; never the laptop's kchain.

The training process inside the kernel (`python -m kchain.runtime.launch`): the Run and its parts.
Embedded into every notebook beside kchain.common, so it runs with the internet off. The laptop never
imports it (it names `kchain.runtime.launch` only to start it); this file stays empty of imports.
"""
