"""How fast the emulator answers status polls through the unmodified client.

    python bench/emulator_overhead.py [N]

Prints polls per second for N GetKernelSessionStatus calls (default 500) made with the real
`kaggle` client through the emulator's proxy, and the ratio to the 100 polls/s kchain needs for
its tests to poll freely. A ratio above 1 means the emulator is not what slows a test down.
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

os.environ["KAGGLE_API_ENVIRONMENT"] = "LOCALHOST"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from emulator_helpers import write_kernel  # noqa: E402

from kchain.emulator import Emulator  # noqa: E402

TARGET_PER_S = 100


def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        (home / ".kaggle").mkdir(parents=True)
        os.environ.update({"HOME": str(home), "KAGGLE_CONFIG_DIR": str(home / ".kaggle")})
        with Emulator(Path(tmp) / "state", users={"alice": secrets.token_hex(16)}) as emu:
            os.environ.update(emu.env("alice"))
            from kaggle.api.kaggle_api_extended import KaggleApi

            api = KaggleApi()
            api.authenticate()
            api.kernels_push(str(write_kernel(Path(tmp) / "k", "alice/bench-kernel", ["print(1)"])), no_run=True)
            start = time.perf_counter()
            for _ in range(n):
                api.kernels_status("alice/bench-kernel")
            rate = n / (time.perf_counter() - start)
    print(f"status polls: {n} in {n / rate:.2f} s = {rate:.0f}/s; ratio to {TARGET_PER_S}/s: {rate / TARGET_PER_S:.1f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 500)
