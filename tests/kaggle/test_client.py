# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""kchain.kaggle.client against the emulator: retries, timeouts and the one-line credential errors."""

from __future__ import annotations

import socket

import pytest
from emulator_helpers import USER, emulator, fake_key, wait_dataset_ready, write_dataset, write_kernel  # noqa: F401

from kchain.errors import CredentialsError, KaggleError
from kchain.kaggle.client import MISSING_CREDENTIALS, REJECTED_CREDENTIALS, KaggleClient, OutcomeUnknown


def _client() -> KaggleClient:
    return KaggleClient(timeout_s=10, attempts=8, backoff_s=0.01, sleep=lambda s: None)


def test_calls_succeed_when_30_percent_of_them_fail(emulator, tmp_path):
    client = _client()
    emulator.faults.seed = 7
    emulator.faults.rate_429 = 0.3  # creating calls: only unambiguous refusals
    write_dataset(tmp_path / "ds", "alice/flaky-state", {"state.json": "{}", "ckpt/last.pt": b"\1" * 100})
    assert client.create_dataset(tmp_path / "ds") == "alice/flaky-state"
    emulator.faults.rate_429 = 0.0
    wait_dataset_ready(client.api, "alice/flaky-state")  # a new version is invisible for a while
    emulator.faults.rate_429 = 0.3
    write_kernel(tmp_path / "k", "alice/flaky-kernel", ["open('o.txt', 'w').write('ok')\nprint('logged')"],
                 dataset_sources=["alice/flaky-state"])
    version, url = client.push(tmp_path / "k")
    assert version == 1 and url.endswith("/code/alice/flaky-kernel")
    emulator.wait_session("alice/flaky-kernel")

    emulator.faults.rate_429, emulator.faults.rate_500 = 0.15, 0.15
    emulator.switches.quota_has_gpu = True
    calls_before = sum(emulator.calls.values())
    assert client.status("alice/flaky-kernel", 1) == ("COMPLETE", "")
    files, log = client.output("alice/flaky-kernel", 1, tmp_path / "out")
    assert [f.name for f in files] == ["o.txt"] and "logged" in log
    assert client.dataset_status("alice/flaky-state") == "ready"
    assert client.dataset_version_number("alice/flaky-state") == 1
    assert client.dataset_exists("alice/flaky-state") and not client.dataset_exists("alice/not-there")
    client.download_dataset("alice/flaky-state", 1, tmp_path / "dl")
    assert (tmp_path / "dl/ckpt/last.pt").read_bytes() == b"\1" * 100
    quota = client.quota()
    assert quota is not None and quota["total_s"] == 30 * 3600
    assert sum(emulator.calls.values()) - calls_before > 9  # some calls were answered with faults and retried


def test_a_push_whose_answer_is_lost_is_not_retried(emulator, tmp_path):
    client = _client()
    write_kernel(tmp_path / "k", "alice/ambiguous-push", ["print(1)"])
    emulator.faults.rate_500 = 1.0
    with pytest.raises(OutcomeUnknown):
        client.push(tmp_path / "k")
    assert emulator.calls["SaveKernel"] == 1


def test_refused_push_raises_with_kaggles_reason(emulator, tmp_path):
    emulator.max_gpu_sessions = 0
    write_kernel(tmp_path / "k", "alice/gpu-refused", ["print(1)"], enable_gpu=True)
    with pytest.raises(KaggleError, match="Maximum batch GPU session count of 0 reached"):
        _client().push(tmp_path / "k")


def test_rejected_credentials_are_one_line(emulator, monkeypatch):
    monkeypatch.setenv("KAGGLE_KEY", fake_key())
    with pytest.raises(CredentialsError) as info:
        _client().status("alice/any-kernel")
    assert str(info.value) == REJECTED_CREDENTIALS


def test_missing_credentials_are_one_line(monkeypatch):
    for name in ("KAGGLE_USERNAME", "KAGGLE_KEY", "KAGGLE_API_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(CredentialsError) as info:
        _client().status("alice/any-kernel")
    assert str(info.value) == MISSING_CREDENTIALS


def test_a_hung_server_times_out(tmp_path, monkeypatch):
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        monkeypatch.setenv("HTTP_PROXY", url)
        monkeypatch.setenv("NO_PROXY", "")
        monkeypatch.setenv("KAGGLE_USERNAME", USER)
        monkeypatch.setenv("KAGGLE_KEY", fake_key())
        client = KaggleClient(timeout_s=0.3, attempts=2, sleep=lambda s: None)
        with pytest.raises(KaggleError, match="Timeout"):
            client.status("alice/any-kernel")
        write_kernel(tmp_path / "k", "alice/hung-push", ["print(1)"])
        with pytest.raises(OutcomeUnknown):
            client.push(tmp_path / "k")


def test_no_network_and_nothing_listening_are_one_line_at_once(monkeypatch):
    # A name that cannot resolve (RFC 2606's .invalid) and a port nothing listens on: each is one line naming
    # the cause, said at the first try (a retry would fail the same way).
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("NO_PROXY", "")
    monkeypatch.setenv("KAGGLE_USERNAME", USER)
    monkeypatch.setenv("KAGGLE_KEY", fake_key())
    for proxy, said in ((f"http://127.0.0.1:{port}", f"127.0.0.1:{port} refused the connection"),
                        ("http://kaggle-api.invalid:8080", "the name kaggle-api.invalid does not resolve")):
        monkeypatch.setenv("HTTP_PROXY", proxy)
        slept: list[float] = []
        with pytest.raises(KaggleError) as raised:
            KaggleClient(sleep=slept.append).status("alice/any-kernel")
        assert f"cannot reach Kaggle: {said}" in str(raised.value) and "\n" not in str(raised.value)
        assert slept == []


def test_a_long_transfer_says_how_far_it_is_in_lines_of_its_own(tmp_path):
    import time

    from kchain.kaggle.client import transfer_progress

    lines: list[str] = []
    dest = tmp_path / "out"
    dest.mkdir()
    with transfer_progress(True, "downloading", "alice/data/3", dest, every_s=0.05, write=lines.append):
        (dest / "part").write_bytes(b"x" * 2_000_000)
        while not any("2.0 MB" in line for line in lines):
            time.sleep(0.01)
    assert lines[-1].startswith("  downloading alice/data/3: 2.0 MB so far (")
    quiet: list[str] = []
    with transfer_progress(False, "uploading", "x", dest, every_s=0.01, write=quiet.append):
        time.sleep(0.05)
    assert quiet == []
