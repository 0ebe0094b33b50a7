# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""The local Kaggle, driven by the unmodified `kaggle` client over real HTTP."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import psutil
import pytest
import requests
from emulator_helpers import (  # noqa: F401
    PATIENCE_S,
    USER,
    emulator,
    fake_key,
    kaggle_api,
    wait_dataset_mounted,
    wait_dataset_ready,
    write_dataset,
    write_kernel,
)

from kchain.emulator import Emulator, Faults
from kchain.emulator.app import PATIENCE_S

KAGGLE_CLI = Path(sys.executable).parent / "kaggle"


def _status(api, ref: str, version: int | None = None) -> str:
    return api.kernels_status(f"{ref}/{version}" if version else ref).status.name


def test_push_runs_the_notebook_and_its_output_and_log_download(emulator, kaggle_api, tmp_path):
    write_dataset(tmp_path / "ds", "alice/input-data", {"a.txt": "hello"})
    kaggle_api.dataset_create_new(str(tmp_path / "ds"), quiet=True)
    wait_dataset_mounted(kaggle_api, "alice/input-data", emulator)
    cell = (
        "import os, json, pathlib\n"
        "inp = pathlib.Path(os.environ['KCHAIN_ROOT']) / 'input/datasets/alice/input-data/a.txt'\n"
        "writable = bool(inp.stat().st_mode & 0o222) or bool(inp.parent.stat().st_mode & 0o222)\n"
        "keys = sorted(k for k in os.environ if k in ('KAGGLE_KEY', 'KAGGLE_USERNAME', 'KAGGLE_API_TOKEN'))\n"
        "pathlib.Path('sub').mkdir()\n"
        "pathlib.Path('sub/result.json').write_text(json.dumps({'input': inp.read_text(), 'writable': writable,\n"
        "    'run_type': os.environ['KAGGLE_KERNEL_RUN_TYPE'], 'cred_keys': keys}))\n"
        "print('hello from the session')"
    )
    write_kernel(tmp_path / "k", "alice/hello-session", [cell], dataset_sources=["alice/input-data"])
    pushed = kaggle_api.kernels_push(str(tmp_path / "k"))
    assert pushed.error == "" and pushed.version_number == 1
    assert _status(kaggle_api, "alice/hello-session", 1) in ("QUEUED", "RUNNING")

    assert emulator.wait_session("alice/hello-session")["status"] == "COMPLETE"
    assert _status(kaggle_api, "alice/hello-session", 1) == "COMPLETE"
    files, _ = kaggle_api.kernels_output("alice/hello-session/1", str(tmp_path / "out"))
    result = json.loads((tmp_path / "out/sub/result.json").read_text())
    assert result == {"input": "hello", "writable": False, "run_type": "Batch", "cred_keys": []}
    log = json.loads((tmp_path / "out/hello-session.log").read_text())
    assert any("hello from the session" in entry["data"] for entry in log)
    assert {"stream_name", "time", "data"} <= set(log[0])
    assert str(tmp_path / "out/hello-session.log") in files

    pulled = tmp_path / "pulled"
    kaggle_api.kernels_pull("alice/hello-session", str(pulled), metadata=True)
    meta = json.loads((pulled / "kernel-metadata.json").read_text())
    assert meta["dataset_sources"] == ["alice/input-data"]
    assert "hello from the session" in (pulled / meta["code_file"]).read_text()


def test_session_is_killed_at_its_time_limit(emulator, kaggle_api, tmp_path):
    write_kernel(tmp_path / "k", "alice/sleepy-kernel", ["import time\ntime.sleep(120)"])
    kaggle_api.kernels_push(str(tmp_path / "k"), timeout="2")
    session = emulator.wait_session("alice/sleepy-kernel")
    assert session["status"] == "ERROR" and "time limit of 2 seconds" in session["failure_message"]
    assert not psutil.pid_exists(session["pid"]) or psutil.Process(session["pid"]).status() == "zombie"
    status = kaggle_api.kernels_status("alice/sleepy-kernel")
    assert status.status.name == "ERROR" and "time limit" in status.failure_message


def test_injected_kills_and_lost_output(emulator, kaggle_api, tmp_path):
    cell = "import time, pathlib\npathlib.Path('partial.txt').write_text('x')\nprint('KILL-HERE', flush=True)\ntime.sleep(120)"
    emulator.max_cpu_sessions = 3  # three CPU sessions at once: the kills are under test, not the cap
    emulator.faults.kill_after_s = 2.0
    emulator.faults.lose_output = True
    write_kernel(tmp_path / "a", "alice/killed-kernel", [cell])
    kaggle_api.kernels_push(str(tmp_path / "a"))
    emulator.faults.kill_after_s = None
    emulator.faults.lose_output = False
    emulator.faults.kill_on_output = "KILL-HERE"  # after the file was written, however slow the machine
    write_kernel(tmp_path / "b", "alice/marker-kill", [cell])
    kaggle_api.kernels_push(str(tmp_path / "b"))
    emulator.faults.kill_on_output = None
    emulator.faults.kill_random_s = (1.5, 2.5)
    write_kernel(tmp_path / "c", "alice/random-kill", [cell])
    kaggle_api.kernels_push(str(tmp_path / "c"))

    lost = emulator.wait_session("alice/killed-kernel")
    kept = emulator.wait_session("alice/marker-kill")
    drawn = emulator.wait_session("alice/random-kill")
    for session in (lost, kept, drawn):
        assert session["status"] == "ERROR" and "fault injection" in session["failure_message"]
    assert 1.5 <= drawn["kill_at"] <= 2.5
    files, _ = kaggle_api.kernels_output("alice/killed-kernel", str(tmp_path / "out-lost"))
    assert [Path(f).name for f in files] == ["killed-kernel.log"]
    kaggle_api.kernels_output("alice/marker-kill", str(tmp_path / "out-kept"))
    assert (tmp_path / "out-kept/partial.txt").read_text() == "x"


def test_bad_or_missing_credentials_get_401(emulator, monkeypatch):
    monkeypatch.setenv("KAGGLE_KEY", fake_key())
    from kaggle.api.kaggle_api_extended import KaggleApi

    api = KaggleApi()
    api.authenticate()
    with pytest.raises(requests.HTTPError) as info:
        api.dataset_status("alice/whatever-data")
    assert info.value.response is not None and info.value.response.status_code == 401
    answer = requests.post("http://localhost/api/v1/datasets.DatasetApiService/GetDatasetStatus", json={},
                           proxies={"http": emulator.url})
    assert answer.status_code == 401 and answer.json()["code"] == 401
    assert answer.headers["Content-Type"] == "application/json"


def test_dataset_processing_then_ready_download_and_list(emulator, kaggle_api, tmp_path):
    emulator.switches.version_lag_s = 0  # this test is about processing; the lag has its own test
    emulator.faults.processing_s = 600  # long, so no check races the machine; settle() ends it
    folder = write_dataset(tmp_path / "ds", "alice/chain-state", {"state.json": '{"step": 1}', "ckpt/last.pt": b"\0" * 10})
    created = kaggle_api.dataset_create_new(str(folder), quiet=True, dir_mode="zip")
    assert created.status == "ok"
    assert kaggle_api.dataset_status("alice/chain-state") == "blobs_received"
    with pytest.raises(requests.HTTPError) as info:
        kaggle_api.dataset_create_version(str(folder), "too early", quiet=True, dir_mode="zip")
    assert info.value.response is not None and info.value.response.status_code == 403
    with pytest.raises(requests.HTTPError) as info:
        kaggle_api.dataset_list_files("alice/chain-state/1")
    assert info.value.response is not None and info.value.response.status_code == 404

    emulator.settle("alice/chain-state")
    assert kaggle_api.dataset_status("alice/chain-state") == "ready"
    emulator.faults.processing_s = 0
    (folder / "state.json").write_text('{"step": 2}')
    # The client resumes the refused attempt's finished uploads if name, size and mtime (whole seconds)
    # match: a file rewritten in the same second with the same size would go up stale.
    later = time.time() + 5
    os.utime(folder / "state.json", (later, later))
    assert kaggle_api.dataset_create_version(str(folder), "session 2", quiet=True, dir_mode="zip").status == "ok"
    assert json.loads(kaggle_api.dataset_status("alice/chain-state", format="json")) == {
        "status": "ready", "current_version_number": 2}

    kaggle_api.dataset_download_files("alice/chain-state/1", str(tmp_path / "dl1"), unzip=True, quiet=True)
    assert (tmp_path / "dl1/state.json").read_text() == '{"step": 1}'
    assert (tmp_path / "dl1/ckpt/last.pt").read_bytes() == b"\0" * 10
    kaggle_api.dataset_download_files("alice/chain-state", str(tmp_path / "dl2"), quiet=True)
    with zipfile.ZipFile(tmp_path / "dl2/chain-state.zip") as zf:
        assert zf.read("state.json") == b'{"step": 2}'
    listed = kaggle_api.dataset_list_files("alice/chain-state/2")
    assert sorted((f.name, f.total_bytes) for f in listed.files) == [("ckpt/last.pt", 10), ("state.json", 11)]
    assert [v["notes"] for v in emulator.dataset_versions("alice/chain-state")] == ["Initial release", "session 2"]
    with pytest.raises(requests.HTTPError) as info:
        kaggle_api.dataset_status("alice/no-such-data")
    assert info.value.response is not None and info.value.response.status_code == 403


def test_upload_resumes_after_a_dropped_connection(emulator, kaggle_api, tmp_path):
    data = os.urandom(2_000_000)
    folder = write_dataset(tmp_path / "ds", "alice/big-upload", {"blob.bin": data})
    emulator.faults.drop_upload_every = 2  # the first PUT is cut off; the client's own retry goes through
    assert kaggle_api.dataset_create_new(str(folder), quiet=True).status == "ok"
    assert emulator.calls["upload_drop"] == 1
    wait_dataset_ready(kaggle_api, "alice/big-upload")

    # A client killed while its upload hangs half-way resumes next time with the `bytes */N` probe and a
    # ranged PUT. The stall is counted once half the body is stored, and the client, waiting for an answer
    # that never comes, does nothing more until it is killed: what it left does not depend on timing.
    emulator.faults.drop_upload_every, emulator.faults.stall_upload = 0, 1
    cmd = [str(KAGGLE_CLI), "datasets", "version", "-p", str(folder), "-m", "v2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + PATIENCE_S
    while emulator.calls["upload_stall"] < 1 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert emulator.calls["upload_stall"] == 1
    starts = emulator.calls["StartBlobUpload"]
    assert kaggle_api.dataset_create_version(str(folder), "v2", quiet=True).status == "ok"
    assert emulator.calls["StartBlobUpload"] == starts
    assert emulator.calls["upload_probe"] == 1 and emulator.calls["upload_resume"] == 1
    wait_dataset_ready(kaggle_api, "alice/big-upload")
    kaggle_api.dataset_download_files("alice/big-upload/2", str(tmp_path / "dl"), unzip=True, quiet=True)
    assert hashlib.sha256((tmp_path / "dl/blob.bin").read_bytes()).digest() == hashlib.sha256(data).digest()


def test_api_faults_reach_the_client(emulator, kaggle_api, tmp_path):
    emulator.faults.rate_429 = 1.0
    with pytest.raises(requests.HTTPError) as info:
        kaggle_api.kernels_status("alice/any-kernel")
    assert info.value.response is not None and info.value.response.status_code == 429 and info.value.response.headers["Retry-After"] == "1"
    emulator.faults.rate_429, emulator.faults.rate_500 = 0.0, 1.0
    with pytest.raises(requests.HTTPError) as info:
        kaggle_api.dataset_status("alice/any-dataset")
    assert info.value.response is not None and info.value.response.status_code == 500

    # The client retries 429 on the create RPCs (honouring Retry-After) and gets through.
    folder = write_dataset(tmp_path / "ds", "alice/flaky-create", {"a.txt": "a"})
    emulator.faults.rate_500, emulator.faults.rate_429, emulator.faults.seed = 0.0, 0.5, 3
    before = sum(emulator.calls.values())
    assert kaggle_api.dataset_create_new(str(folder), quiet=True).status == "ok"
    emulator.faults.rate_429 = 0.0
    assert sum(emulator.calls.values()) - before > 3  # status + upload start + create, some of them twice
    assert emulator.dataset_versions("alice/flaky-create")[0]["files"] == [{"name": "a.txt", "size": 1}]


def test_gpu_concurrency_cap_and_weekly_quota(emulator, kaggle_api, tmp_path):
    emulator.switches.quota_has_gpu = True
    sleeper = ["import time\ntime.sleep(120)"]
    for name in ("gpu-one-run", "gpu-two-run"):
        write_kernel(tmp_path / name, f"alice/{name}", sleeper, enable_gpu=True)
        assert kaggle_api.kernels_push(str(tmp_path / name), timeout="3").error == ""
    write_kernel(tmp_path / "third", "alice/gpu-three-run", sleeper, machine_shape="NvidiaTeslaT4")
    refused = kaggle_api.kernels_push(str(tmp_path / "third"))
    assert refused.error == "Maximum batch GPU session count of 2 reached"
    write_kernel(tmp_path / "cpu", "alice/cpu-only-run", ["print(1)"])
    assert kaggle_api.kernels_push(str(tmp_path / "cpu")).error == ""  # CPU sessions are not capped

    for name in ("gpu-one-run", "gpu-two-run"):
        emulator.wait_session(f"alice/{name}")
    emulator.gpu_quota_s = 4  # two sessions of ~3 s used ~6 s of GPU time this week
    refused = kaggle_api.kernels_push(str(tmp_path / "third"))
    assert "GPU quota exceeded" in refused.error
    quota = kaggle_api.quota_view()
    assert quota.gpu_quota.time_used.total_seconds() >= 4
    assert quota.quota_refresh_time.weekday() == 5  # Saturday 00:00 UTC


def test_state_survives_a_restart(tmp_path, monkeypatch):
    key = fake_key()
    state = tmp_path / "state"
    emu = Emulator(state, users={USER: key}, session_limit_s=PATIENCE_S)
    emu.start()
    for name, value in emu.env(USER).items():
        monkeypatch.setenv(name, value)
    from kaggle.api.kaggle_api_extended import KaggleApi

    api = KaggleApi()
    api.authenticate()
    api.dataset_create_new(str(write_dataset(tmp_path / "ds", "alice/kept-data", {"a.txt": "kept"})), quiet=True)
    wait_dataset_ready(api, "alice/kept-data")
    write_kernel(tmp_path / "done", "alice/done-kernel", ["open('o.txt', 'w').write('done')"])
    api.kernels_push(str(tmp_path / "done"))
    emu.wait_session("alice/done-kernel")
    write_kernel(tmp_path / "live", "alice/live-kernel", ["import time\ntime.sleep(120)"])
    api.kernels_push(str(tmp_path / "live"))
    deadline = time.time() + PATIENCE_S
    while not emu.session("alice/live-kernel").get("pid") and time.time() < deadline:  # booted, notebook runs
        time.sleep(0.05)
    pid = emu.session("alice/live-kernel")["pid"]
    emu.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"

    with Emulator(state, users={USER: key}) as again:
        for name, value in again.env(USER).items():
            monkeypatch.setenv(name, value)
        api = KaggleApi()
        api.authenticate()
        live = api.kernels_status("alice/live-kernel")
        assert live.status.name == "ERROR" and live.failure_message == "session lost: emulator restarted"
        assert api.kernels_status("alice/done-kernel").status.name == "COMPLETE"
        api.kernels_output("alice/done-kernel", str(tmp_path / "out"))
        assert (tmp_path / "out/o.txt").read_text() == "done"
        api.dataset_download_files("alice/kept-data", str(tmp_path / "dl"), unzip=True, quiet=True)
        assert (tmp_path / "dl/a.txt").read_text() == "kept"


def test_kaggle_cli_subprocess_reads_status(emulator, kaggle_api, tmp_path):
    write_kernel(tmp_path / "k", "alice/quick-saved", ["print(1)"])
    kaggle_api.kernels_push(str(tmp_path / "k"), no_run=True)
    done = subprocess.run([str(KAGGLE_CLI), "kernels", "status", "alice/quick-saved"],
                          capture_output=True, text=True, timeout=PATIENCE_S)
    assert done.returncode == 0, done.stderr
    assert 'alice/quick-saved has status "KernelWorkerStatus.COMPLETE"' in done.stdout
    assert emulator.calls["GetKernelSessionStatus"] == 1


def test_token_auth_uses_introspection(tmp_path, monkeypatch):
    token = f"KGAT_{fake_key()}"
    with Emulator(tmp_path / "state", tokens={token: USER}) as emu:
        for name, value in emu.env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("KAGGLE_API_TOKEN", token)
        from kaggle.api.kaggle_api_extended import KaggleApi  # the package's first import authenticates too

        before = emu.calls["IntrospectToken"]  # so this test counts the same run alone or after others
        api = KaggleApi()
        api.authenticate()
        assert emu.calls["IntrospectToken"] == before + 1 and api.config_values["username"] == USER
        write_kernel(tmp_path / "k", "alice/token-pushed", ["print(1)"])
        assert api.kernels_push(str(tmp_path / "k"), no_run=True).version_number == 1

        monkeypatch.setenv("KAGGLE_API_TOKEN", f"KGAT_{fake_key()}")
        monkeypatch.setenv("KAGGLE_USERNAME", USER)
        monkeypatch.setenv("KAGGLE_KEY", fake_key())
        api = KaggleApi()
        api.authenticate()
        with pytest.raises(requests.HTTPError) as info:
            api.dataset_status("alice/any-dataset")
        assert info.value.response is not None and info.value.response.status_code == 401


def test_internet_secrets_and_offline_sessions(tmp_path, monkeypatch):
    key, secret = fake_key(), fake_key()
    with Emulator(tmp_path / "state", users={USER: key}, secrets={USER: {"KAGGLE_KEY": secret}}) as emu:
        for name, value in emu.env(USER).items():
            monkeypatch.setenv(name, value)
        from kaggle.api.kaggle_api_extended import KaggleApi

        api = KaggleApi()
        api.authenticate()
        online = ("import hashlib, pathlib\nfrom kaggle_secrets import UserSecretsClient\n"
                  "s = UserSecretsClient().get_secret('KAGGLE_KEY')\n"
                  "pathlib.Path('digest.txt').write_text(hashlib.sha256(s.encode()).hexdigest())")
        offline = ("import pathlib, urllib.request\ntry:\n    urllib.request.urlopen('http://localhost/', timeout=5)\n"
                   "    r = 'reached'\nexcept Exception as e:\n    r = 'blocked'\npathlib.Path('net.txt').write_text(r)")
        write_kernel(tmp_path / "on", "alice/online-kernel", [online], enable_internet=True)
        write_kernel(tmp_path / "off", "alice/offline-kernel", [offline], enable_internet=False)
        emu.attach_secrets("alice/online-kernel")  # the user attached them in the web UI
        api.kernels_push(str(tmp_path / "on"))
        api.kernels_push(str(tmp_path / "off"))
        assert emu.wait_session("alice/online-kernel")["status"] == "COMPLETE"
        assert emu.wait_session("alice/offline-kernel")["status"] == "COMPLETE"
        api.kernels_output("alice/online-kernel", str(tmp_path / "on-out"))
        api.kernels_output("alice/offline-kernel", str(tmp_path / "off-out"))
        assert (tmp_path / "on-out/digest.txt").read_text() == hashlib.sha256(secret.encode()).hexdigest()
        assert (tmp_path / "off-out/net.txt").read_text() == "blocked"
        for path in (tmp_path / "state").rglob("*"):
            if path.is_file():
                assert secret.encode() not in path.read_bytes() and key.encode() not in path.read_bytes()


def test_a_lost_answer_after_a_creating_call_has_acted(emulator, kaggle_api, tmp_path):
    emulator.switches.version_lag_s = 0
    emulator.faults.rate_lost_answer = 1.0
    folder = write_dataset(tmp_path / "ds", "alice/lost-answer", {"a.txt": "a"})
    with pytest.raises(requests.HTTPError) as info:
        kaggle_api.dataset_create_new(str(folder), quiet=True)
    assert info.value.response is not None and info.value.response.status_code == 500
    assert len(emulator.dataset_versions("alice/lost-answer")) == 1  # it was created all the same
    with pytest.raises(requests.HTTPError):
        kaggle_api.dataset_create_version(str(folder), "v2", quiet=True)
    assert len(emulator.dataset_versions("alice/lost-answer")) == 2
    write_kernel(tmp_path / "k", "alice/lost-push", ["print(1)"])
    with pytest.raises(requests.HTTPError):
        kaggle_api.kernels_push(str(tmp_path / "k"))
    assert emulator.calls["SaveKernel"] == 1 and len(emulator.sessions()) == 1  # pushed once, answer lost

    emulator.faults.rate_lost_answer, emulator.faults.seed = 0.5, 11
    outcomes = [emulator.faults.lose_answer() for _ in range(200)]
    assert 0 < sum(outcomes) < 200  # a rate, not all or nothing


def test_the_faults_one_call_meets_do_not_shift_with_how_many_other_calls_came_first():
    # A slower machine polls a session's status more often before it pushes: the push's faults stay the same.
    def pushes(polls_between: int) -> list:
        faults = Faults(rate_429=0.2, rate_500=0.2, rate_lost_answer=0.3, seed=7)
        seen = []
        for _ in range(30):
            for _ in range(polls_between):
                faults.api_fault("GetKernelSessionStatus")
            seen.append((faults.api_fault("SaveKernel"), faults.lose_save_answer()))
        return seen

    assert pushes(0) == pushes(1) == pushes(7)
    assert {code for code, _ in pushes(0)} == {None, 429, 500} and any(lost for _, lost in pushes(0))
    assert pushes(0) != [(f.api_fault("SaveKernel"), f.lose_save_answer())
                         for f in [Faults(rate_429=0.2, rate_500=0.2, rate_lost_answer=0.3, seed=8)] for _ in range(30)]


def test_sessions_record_the_step_they_resumed_from(emulator, kaggle_api, tmp_path):
    summary = ("import json, pathlib\npathlib.Path('out').mkdir()\n"
               "pathlib.Path('out/summary.json').write_text(json.dumps({'status': 'done', 'step': 50, 'total': 90,"
               " 'resumed_from': 42}))")
    logged = "print('[kchain] resumed from step 7 (x, saved at y)', flush=True)\nimport time\ntime.sleep(600)"
    write_kernel(tmp_path / "a", "alice/with-summary", [summary])
    write_kernel(tmp_path / "b", "alice/with-log-only", [logged])
    kaggle_api.kernels_push(str(tmp_path / "a"))
    emulator.faults.kill_on_output, emulator.faults.lose_output = "resumed from step", True
    kaggle_api.kernels_push(str(tmp_path / "b"))
    done = emulator.wait_session("alice/with-summary")
    assert done["resumed_from"] == 42 and done["summary"] == {"status": "done", "step": 50, "total": 90,
                                                              "resumed_from": 42, "started": None, "ended": None}
    killed = emulator.wait_session("alice/with-log-only")
    assert killed["output_lost"] and killed["summary"] is None and killed["resumed_from"] == 7


def test_a_client_that_hangs_up_prints_nothing_but_a_server_bug_still_does(emulator, capsys):
    # A client that drops a keep-alive connection (the log stream's, once it read END_OF_LOG) reset
    # the server's next read; socketserver printed that traceback into the CLI's own output.
    for exc, printed in ((ConnectionResetError(104, "Connection reset by peer"), False), (BrokenPipeError(32, "Broken pipe"), False),
                         (ValueError("a bug in a handler"), True)):
        try:
            raise exc
        except Exception:
            emulator._server.handle_error(None, ("127.0.0.1", 1))
        assert ("Traceback" in capsys.readouterr().err) is printed, exc
