"""SkyPilot's own check of a rendered work folder: `python skycheck.py FOLDER STORE BUCKET`.

Standard library and SkyPilot only, so any Python that has SkyPilot runs it: SkyPilot's own
(`pipx install skypilot==0.14.1` or `uv tool install skypilot==0.14.1`, which keep its pin of click<8.2
out of kchain's environment), or kchain's if SkyPilot was installed there. It reads the task as `sky jobs launch` does
(`sky.Task.from_yaml` in the work folder, `Task.validate()`) and checks the bucket name with the
store's own validator. Validation reads SkyPilot's accelerator catalog from
$SKY_RUNTIME_DIR/.sky/catalogs/ (SkyPilot downloads it on first use; the tests ship a small copy).
Prints `ok SKYPILOT_VERSION` or `error FIRST LINE`, and exits 0 or 1.
"""

from __future__ import annotations

import os
import sys

TASK_FILE = "task.yaml"
# SkyPilot's store classes (sky.data.storage), each with its validate_name, by the task YAML's store name.
STORE_CLASSES = {"s3": "S3Store", "gcs": "GcsStore", "r2": "R2Store", "azure": "AzureBlobStore",
                 "ibm": "IBMCosStore", "oci": "OciStore", "nebius": "NebiusStore", "coreweave": "CoreWeaveStore"}


def check(folder: str, store: str, bucket: str) -> str:
    """SkyPilot's version when the task and the bucket name are valid; raises what SkyPilot raises."""
    import sky
    from sky.data import storage

    os.chdir(folder)  # workdir: . is the work folder, as `sky jobs launch` runs there
    task = sky.Task.from_yaml(os.path.join(folder, TASK_FILE))
    task.validate()
    getattr(storage, STORE_CLASSES[store]).validate_name(bucket)
    return sky.__version__


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("error usage: skycheck.py FOLDER STORE BUCKET")
        return 2
    try:
        version = check(os.path.abspath(argv[0]), argv[1], argv[2])
    except Exception as exc:  # SkyPilot raises ValueError, StorageNameError and its own exception types
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        print(f"error {lines[0][:300]}")
        return 1
    print(f"ok {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
