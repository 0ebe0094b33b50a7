"""What kchain reaches into in the official client and its SDK is still there, by name.

kchain/kaggle/client.py patches the client's HTTP session (a timeout on every call), replaces its
`with_retry` for the calls that create something, builds a kagglesdk request itself and reads the
SDK's response types. kagglesdk is not meant for direct use (Kaggle/kaggle-sdk-python#51) and moved
0.1.33 -> 0.1.38 in three months, so both are pinned (pyproject.toml) and this test names each
missing piece after an upgrade, instead of a chain failing half-way on Kaggle.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import re
import secrets
from pathlib import Path

import requests

from kchain.kaggle.client import CREATING_SDK_CALLS, KaggleClient, _TimeoutAdapter

REPO = Path(__file__).resolve().parents[2]

# Each client method kchain calls, with the keyword arguments it passes.
CLIENT_CALLS = {
    "authenticate": [], "build_kaggle_client": [], "with_retry": ["func"],
    "kernels_push": ["folder", "timeout", "acc", "no_run"], "kernels_status": ["kernel"],
    "kernels_output": ["kernel", "path", "force", "quiet"], "kernels_logs": ["kernel"],
    "kernels_logs_stream": ["kernel"], "kernels_list": ["mine", "page", "page_size", "sort_by"], "quota_view": [],
    "dataset_status": ["dataset", "format"], "dataset_create_new": ["folder", "public", "quiet", "dir_mode"],
    "dataset_create_version": ["folder", "version_notes", "quiet", "dir_mode", "delete_old_versions"],
    "dataset_download_files": ["dataset", "path", "force", "quiet", "unzip"],
    "model_instance_versions_list": ["model_instance", "page_size", "page_token"],
}
# Each kagglesdk type kchain builds or reads, with the fields it touches.
SDK_TYPES = {
    "kagglesdk.kernels.types.kernels_api_service": {
        "ApiGetKernelRequest": ["user_name", "kernel_slug"],
        "ApiGetKernelResponse": ["metadata"],
        "ApiKernelMetadata": ["ref", "current_version_number", "enable_gpu", "machine_shape", "last_run_time"],
        "ApiSaveKernelResponse": ["error", "version_number", "url", "invalid_dataset_sources",
                                  "invalid_kernel_sources", "invalid_competition_sources", "invalid_model_sources"],
        "ApiGetKernelSessionStatusResponse": ["status", "failure_message"],
        "ApiGetAcceleratorQuotaStatisticsResponse": ["quota_refresh_time", "gpu_quota"],
        "ApiAcceleratorQuota": ["time_used", "total_time_allowed"],
    },
    "kagglesdk.datasets.types.dataset_api_service": {"ApiCreateDatasetResponse": ["status", "error", "ref"]},
    "kagglesdk.models.types.model_api_service": {
        "ApiListModelInstanceVersionsResponse": ["version_list", "next_page_token"],
    },
}
# The SDK clients whose methods kchain names (CREATING_SDK_CALLS, get_kernel).
SDK_CLIENTS = {"kernels.kernels_api_client": ["get_kernel", "save_kernel"],
               "datasets.dataset_api_client": ["create_dataset", "create_dataset_version",
                                               "create_dataset_version_by_id"]}


def _pins() -> dict[str, str]:
    text = (REPO / "pyproject.toml").read_text()
    return dict(re.findall(r'"(kaggle|kagglesdk)==([\w.]+)"', text))


def _missing_client_calls(api: object) -> list[str]:
    missing = []
    for name, params in CLIENT_CALLS.items():
        method = getattr(api, name, None)
        if method is None:
            missing.append(f"KaggleApi.{name}")
            continue
        known = inspect.signature(method).parameters
        missing += [f"KaggleApi.{name}({param}=...)" for param in params if param not in known]
    return missing


def _missing_sdk_types() -> list[str]:
    import importlib

    missing = []
    for module_name, types in SDK_TYPES.items():
        module = importlib.import_module(module_name)
        for type_name, fields in types.items():
            cls = getattr(module, type_name, None)
            if cls is None:
                missing.append(f"{module_name}.{type_name}")
                continue
            missing += [f"{type_name}.{field}" for field in fields if not isinstance(getattr(cls, field, None), property)]
    return missing


def _missing_in_the_built_client(client: KaggleClient) -> list[str]:
    """kchain's own KaggleApi: the SDK client it builds, its HTTP session (with kchain's timeout
    mounted) and the SDK methods kchain's with_retry recognises by name."""
    missing = []
    sdk = client.api.build_kaggle_client()
    http = getattr(sdk, "_http_client", None)
    session = getattr(http, "_session", None)
    if not isinstance(session, requests.Session):
        missing.append("KaggleClient()._http_client._session (a requests.Session after _init_session())")
    elif not isinstance(session.get_adapter("https://www.kaggle.com"), _TimeoutAdapter):
        missing.append("kchain's timeout adapter on the SDK's HTTP session")
    for path, names in SDK_CLIENTS.items():
        holder = sdk
        for part in path.split("."):
            holder = getattr(holder, part, None)
        missing += [f"kagglesdk {path}.{name}" for name in names if not callable(getattr(holder, name, None))]
    return missing


def _creating_calls_not_recognised() -> list[str]:
    """The client's creating methods must name the SDK calls kchain's with_retry sends only once."""
    from kaggle.api.kaggle_api_extended import KaggleApi

    expected = {"dataset_create_version": ["create_dataset_version", "create_dataset_version_by_id"],
                "dataset_create_new": ["create_dataset"], "kernels_push": ["save_kernel"]}
    problems = []
    for method, calls in expected.items():
        source = inspect.getsource(getattr(KaggleApi, method))
        problems += [f"KaggleApi.{method} no longer calls the SDK's {call}" for call in calls
                     if not re.search(rf"\.{call}\b", source)]
        problems += [f"{call} is not in kaggle_api.CREATING_SDK_CALLS" for call in calls if call not in CREATING_SDK_CALLS]
    return problems


def test_kaggle_and_kagglesdk_are_pinned_to_the_versions_installed():
    installed = {name: importlib.metadata.version(name) for name in ("kaggle", "kagglesdk")}
    assert _pins() == installed, f"pyproject.toml pins {_pins()}, the venv has {installed}"


def test_every_internal_kchain_reaches_into_is_there(monkeypatch):
    monkeypatch.setenv("KAGGLE_USERNAME", "alice")
    monkeypatch.setenv("KAGGLE_KEY", secrets.token_hex(16))
    from kaggle.api.kaggle_api_extended import KaggleApi

    client = KaggleClient()
    missing = (_missing_client_calls(KaggleApi()) + _missing_sdk_types() + _missing_in_the_built_client(client)
               + _creating_calls_not_recognised())
    assert not missing, ("kaggle / kagglesdk changed under kchain (kchain/kaggle/client.py reaches into these): "
                         + "; ".join(missing))
