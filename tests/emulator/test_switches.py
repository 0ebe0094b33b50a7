# ruff: noqa: F811  (the shared fixtures are imported, then requested by name)
"""One test per strictness switch of the emulator, through the unmodified `kaggle` client over HTTP.

The emulator fixture runs with the strict defaults (kchain.emulator.Switches()); each test shows
the strict behaviour and then flips its switch to show the kind one.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests
from emulator_helpers import (  # noqa: F401
    USER,
    emulator,
    fake_key,
    kaggle_api,
    wait_dataset_mounted,
    wait_dataset_ready,
    write_dataset,
    write_kernel,
)
from helpers import error_line, invoke

from kchain.cli import serve as serve_command
from kchain.emulator import Faults, Switches
from kchain.emulator.app import PATIENCE_S, emulator_options
from kchain.emulator.switches import Limits

KAGGLE_CLI = Path(sys.executable).parent / "kaggle"
LIST_INPUTS = ("import os, json, pathlib\nroot = pathlib.Path(os.environ['KCHAIN_ROOT']) / 'input'\n"
               "found = {str(p.relative_to(root)): p.read_text() for p in root.rglob('*') if p.is_file()}\n"
               "pathlib.Path('inputs.json').write_text(json.dumps(found))")


def _dataset(api, tmp_path: Path, ref: str, files: dict[str, str], ready: bool = True, emu=None) -> Path:
    """A new dataset; ready: waited for; emu: and its mount lag waited out."""
    folder = write_dataset(tmp_path / ref.replace("/", "_"), ref, files)
    assert api.dataset_create_new(str(folder), quiet=True).status == "ok"
    if ready and emu is not None:
        wait_dataset_mounted(api, ref, emu)
    elif ready:
        wait_dataset_ready(api, ref)
    return folder


def _inputs(api, ref: str, dest: Path) -> dict[str, str]:
    api.kernels_output(ref, str(dest))
    return json.loads((dest / "inputs.json").read_text())


def _as(monkeypatch, emu, user: str):
    """The official client authenticated as another user of the same emulator."""
    from kaggle.api.kaggle_api_extended import KaggleApi

    emu.users.setdefault(user, fake_key())
    monkeypatch.setenv("KAGGLE_USERNAME", user)
    monkeypatch.setenv("KAGGLE_KEY", emu.users[user])
    api = KaggleApi()
    api.authenticate()
    return api


def test_missing_or_invisible_answers_403_and_404_is_a_switch(emulator, kaggle_api, tmp_path, monkeypatch):
    bob = _as(monkeypatch, emulator, "bob")
    folder = write_dataset(tmp_path / "bob-ds", "bob/bobs-private", {"a.txt": "b"})
    bob.dataset_create_new(str(folder), quiet=True)  # private by default
    write_kernel(tmp_path / "bob-k", "bob/bobs-kernel", ["print(1)"], is_private=True)
    bob.kernels_push(str(tmp_path / "bob-k"), no_run=True)
    wait_dataset_ready(bob, "bob/bobs-private")
    alice = _as(monkeypatch, emulator, USER)

    for ref in ("alice/no-such-data", "bob/bobs-private"):
        with pytest.raises(requests.HTTPError) as info:
            alice.dataset_status(ref)
        assert info.value.response is not None and info.value.response.status_code == 403
    for ref in ("alice/no-such-kernel", "bob/bobs-kernel"):
        with pytest.raises(ValueError, match="Permission 'kernels.get' was denied"):  # the client's words for 403
            alice.kernels_status(ref)

    emulator.switches.missing_status = 404
    for ref in ("alice/no-such-data", "bob/bobs-private"):
        with pytest.raises(requests.HTTPError) as info:
            alice.dataset_status(ref)
        assert info.value.response is not None and info.value.response.status_code == 404
    with pytest.raises(requests.HTTPError) as info:
        alice.kernels_status("bob/bobs-kernel")
    assert info.value.response is not None and info.value.response.status_code == 404


def test_a_new_version_is_invisible_for_a_while_then_ready(emulator, kaggle_api, tmp_path):
    emulator.switches.version_lag_s = 600  # long, so no check races the machine; settle() ends it
    folder = _dataset(kaggle_api, tmp_path, "alice/lagging-data", {"s.txt": "1"}, ready=False)
    with pytest.raises(requests.HTTPError) as info:
        kaggle_api.dataset_status("alice/lagging-data")
    assert info.value.response is not None and info.value.response.status_code == 404
    emulator.settle("alice/lagging-data")
    assert kaggle_api.dataset_status("alice/lagging-data") == "ready"

    emulator.switches.lag_status = 403
    (folder / "s.txt").write_text("2")
    assert kaggle_api.dataset_create_version(str(folder), "v2", quiet=True).status == "ok"
    with pytest.raises(requests.HTTPError) as info:
        kaggle_api.dataset_status("alice/lagging-data")
    assert info.value.response is not None and info.value.response.status_code == 403
    lagging = json.loads(kaggle_api.dataset_status("alice/lagging-data", format="json(current_version_number)"))
    assert lagging == {"current_version_number": 1}  # the number lags too
    assert [v["visible"] for v in emulator.dataset_versions("alice/lagging-data")] == [True, False]
    emulator.settle("alice/lagging-data")
    assert json.loads(kaggle_api.dataset_status("alice/lagging-data", format="json")) == {
        "status": "ready", "current_version_number": 2}

    emulator.switches.version_lag_s = 0
    (folder / "s.txt").write_text("3")
    kaggle_api.dataset_create_version(str(folder), "v3", quiet=True)
    assert kaggle_api.dataset_status("alice/lagging-data") == "ready"


def test_invalid_sources_are_answered_and_the_session_still_runs_without_them(emulator, kaggle_api, tmp_path):
    _dataset(kaggle_api, tmp_path, "alice/good-data", {"g.txt": "good"}, emu=emulator)
    emulator.faults.processing_s = 600
    _dataset(kaggle_api, tmp_path, "alice/slow-data", {"s.txt": "slow"}, ready=False)
    emulator.faults.processing_s = 0
    emulator.competitions["digit-recognizer"] = [USER]  # rules accepted; "titanic"'s were not
    sources = ["alice/good-data", "alice/no-such-data", "alice/slow-data", "alice/good-data/7"]
    write_kernel(tmp_path / "k", "alice/bad-sources", [LIST_INPUTS], dataset_sources=sources,
                 competition_sources=["digit-recognizer", "titanic"])
    pushed = kaggle_api.kernels_push(str(tmp_path / "k"))
    assert pushed.error == "" and pushed.version_number == 1  # pushed all the same
    assert pushed.invalid_dataset_sources == ["alice/no-such-data", "alice/slow-data", "alice/good-data/7"]
    assert pushed.invalid_competition_sources == ["titanic"]

    session = emulator.wait_session("alice/bad-sources")
    assert session["status"] == "COMPLETE"
    assert session["requested_sources"] == sources and session["mounted"] == ["alice/good-data/1"]
    assert _inputs(kaggle_api, "alice/bad-sources", tmp_path / "out") == {"datasets/alice/good-data/g.txt": "good"}


def test_the_version_pin_is_ignored_unless_switched(emulator, kaggle_api, tmp_path):
    folder = _dataset(kaggle_api, tmp_path, "alice/pinned-data", {"v.txt": "one"})
    (folder / "v.txt").write_text("two")
    kaggle_api.dataset_create_version(str(folder), "v2", quiet=True)
    wait_dataset_mounted(kaggle_api, "alice/pinned-data", emulator)
    write_kernel(tmp_path / "k", "alice/pin-reader", [LIST_INPUTS], dataset_sources=["alice/pinned-data/1"])

    assert kaggle_api.kernels_push(str(tmp_path / "k")).invalid_dataset_sources == []
    assert emulator.wait_session("alice/pin-reader", 1)["mounted"] == ["alice/pinned-data/2"]
    assert _inputs(kaggle_api, "alice/pin-reader/1", tmp_path / "o1") == {"datasets/alice/pinned-data/v.txt": "two"}

    emulator.switches.ignore_version_pin = False
    kaggle_api.kernels_push(str(tmp_path / "k"))
    assert emulator.wait_session("alice/pin-reader", 2)["mounted"] == ["alice/pinned-data/1"]
    assert _inputs(kaggle_api, "alice/pin-reader/2", tmp_path / "o2") == {"datasets/alice/pinned-data/v.txt": "one"}


def test_logs_come_at_the_end_and_the_stream_is_live(emulator, kaggle_api, tmp_path):
    cell = ("import pathlib, time\nprint('first line', flush=True)\n"
            "while not pathlib.Path('go').exists():\n    time.sleep(0.05)\nprint('second line', flush=True)")
    write_kernel(tmp_path / "k", "alice/chatty-kernel", [cell])
    kaggle_api.kernels_push(str(tmp_path / "k"))
    stream = kaggle_api.kernels_logs_stream("alice/chatty-kernel")
    first = next(stream)  # arrives while the session runs
    assert "first line" in first["data"] and first["stream_name"] == "stdout"
    session = emulator.session("alice/chatty-kernel")
    assert session["status"] == "RUNNING"
    assert kaggle_api.kernels_logs("alice/chatty-kernel") == ""  # Kaggle persists the log at the end
    assert kaggle_api.kernels_output("alice/chatty-kernel", str(tmp_path / "early"))[0] == []  # no files, no log
    (emulator.store.session_dir(session["id"]) / "root/working/go").write_text("")
    rest = [event["data"] for event in stream]
    assert any("second line" in line for line in rest)
    assert emulator.wait_session("alice/chatty-kernel")["status"] == "COMPLETE"
    assert "second line" in kaggle_api.kernels_logs("alice/chatty-kernel")
    ended = [event["data"] for event in kaggle_api.kernels_logs_stream("alice/chatty-kernel")]
    assert any("first line" in d for d in ended) and any("second line" in d for d in ended)

    emulator.switches.log_stream = False
    with pytest.raises(requests.HTTPError) as info:
        list(kaggle_api.kernels_logs_stream("alice/chatty-kernel"))
    assert info.value.response is not None and info.value.response.status_code == 404
    info.value.response.close()  # the client leaves a refused stream's response open


def test_secrets_reach_a_pushed_kernel_only_once_attached(tmp_path, monkeypatch):
    from kchain.emulator import Emulator

    secret = fake_key()
    with Emulator(tmp_path / "state", users={USER: fake_key()}, secrets={USER: {"TOKEN": secret}}) as emu:
        for name, value in emu.env(USER).items():
            monkeypatch.setenv(name, value)
        from kaggle.api.kaggle_api_extended import KaggleApi

        api = KaggleApi()
        api.authenticate()
        cell = ("import pathlib\nfrom kaggle_secrets import UserSecretsClient\ntry:\n"
                "    r = 'got ' + str(len(UserSecretsClient().get_secret('TOKEN')))\n"
                "except Exception as e:\n    r = 'denied'\npathlib.Path('r.txt').write_text(r)")
        write_kernel(tmp_path / "k", "alice/secret-user", [cell], enable_internet=True)

        def run(version: int) -> str:
            api.kernels_push(str(tmp_path / "k"))
            assert emu.wait_session("alice/secret-user", version)["status"] == "COMPLETE"
            api.kernels_output(f"alice/secret-user/{version}", str(tmp_path / f"o{version}"))
            return (tmp_path / f"o{version}/r.txt").read_text()

        assert run(1) == "denied"
        emu.attach_secrets("alice/secret-user")  # the user attached them in the web UI, once
        assert run(2) == f"got {len(secret)}"
        assert run(3) == f"got {len(secret)}"  # an attachment outlives pushes
        emu.store.secrets_attached.clear()
        emu.switches.secrets_need_attaching = False
        assert run(4) == f"got {len(secret)}"


def test_output_of_a_session_killed_at_its_limit_is_lost_or_kept(emulator, kaggle_api, tmp_path):
    cell = "import pathlib, time\npathlib.Path('partial.txt').write_text('x')\nprint('WROTE', flush=True)\ntime.sleep(600)"
    for name, mode in (("lost-at-limit", "lost"), ("kept-at-limit", "kept")):
        emulator.switches.output_at_limit = mode
        write_kernel(tmp_path / name, f"alice/{name}", [cell])
        kaggle_api.kernels_push(str(tmp_path / name))
        next(e for e in kaggle_api.kernels_logs_stream(f"alice/{name}") if "WROTE" in e["data"])
        emulator.expire(f"alice/{name}")  # the limit is reached now, after the file was written
        session = emulator.wait_session(f"alice/{name}")
        assert session["status"] == "ERROR" and "time limit" in session["failure_message"]
        assert session["output_lost"] is (mode == "lost")
    files, _ = kaggle_api.kernels_output("alice/lost-at-limit", str(tmp_path / "lost"))
    assert [Path(f).name for f in files] == ["lost-at-limit.log"]
    kaggle_api.kernels_output("alice/kept-at-limit", str(tmp_path / "kept"))
    assert (tmp_path / "kept/partial.txt").read_text() == "x"


def test_sessions_queue_and_the_clock_starts_before_the_first_cell(emulator, kaggle_api, tmp_path):
    emulator.switches.queue_s = 600
    write_kernel(tmp_path / "q", "alice/long-queue", ["print('never')"])
    kaggle_api.kernels_push(str(tmp_path / "q"))
    assert kaggle_api.kernels_status("alice/long-queue").status.name == "QUEUED"
    emulator.cancel("alice/long-queue")  # the user gave up waiting
    assert emulator.wait_session("alice/long-queue")["started"] is None
    assert emulator.cancellations()[0]["status_before"] == "QUEUED"

    emulator.switches.queue_s, emulator.switches.boot_s = 1.5, 1.0
    write_kernel(tmp_path / "k", "alice/queued-kernel", ["print('ran')"])
    kaggle_api.kernels_push(str(tmp_path / "k"))
    session = emulator.wait_session("alice/queued-kernel")
    assert session["status"] == "COMPLETE"
    assert session["started"] - session["queued"] >= 1.5  # queue time is not session time
    assert session["first_cell"] - session["started"] >= 1.0  # boot time is

    emulator.switches.queue_s, emulator.switches.boot_s = 0.0, 30.0
    write_kernel(tmp_path / "b", "alice/slow-boot", ["print('never')"])
    kaggle_api.kernels_push(str(tmp_path / "b"), timeout="2")
    session = emulator.wait_session("alice/slow-boot")
    assert session["status"] == "ERROR" and "time limit of 2 seconds" in session["failure_message"]
    assert "first_cell" not in session  # the limit ran out while the container booted


def test_tpu_sessions_end_at_the_tpu_limit_and_the_quota_may_have_no_gpu(emulator, kaggle_api, tmp_path):
    assert Switches().tpu_session_limit_s == 9 * 3600
    emulator.switches.tpu_session_limit_s = 2
    write_kernel(tmp_path / "t", "alice/tpu-kernel", ["import time\ntime.sleep(120)"], enable_tpu=True)
    write_kernel(tmp_path / "c", "alice/cpu-kernel", ["import time\ntime.sleep(4)"])
    kaggle_api.kernels_push(str(tmp_path / "t"))
    kaggle_api.kernels_push(str(tmp_path / "c"))
    tpu = emulator.wait_session("alice/tpu-kernel")
    assert tpu["tpu"] and tpu["limit_s"] == 2
    assert tpu["status"] == "ERROR" and "time limit of 2 seconds" in tpu["failure_message"]
    assert emulator.wait_session("alice/cpu-kernel")["status"] == "COMPLETE"

    quota = kaggle_api.quota_view()
    assert quota.gpu_quota is None and quota.tpu_quota is not None
    emulator.switches.quota_has_gpu = True
    assert kaggle_api.quota_view().gpu_quota.total_time_allowed.total_seconds() == emulator.gpu_quota_s


def test_cancel_and_the_mine_lists(emulator, kaggle_api, tmp_path):
    from kagglesdk.kernels.types.kernels_api_service import ApiCancelKernelSessionRequest

    _dataset(kaggle_api, tmp_path, "alice/listed-data", {"a.txt": "a"})
    write_kernel(tmp_path / "k", "alice/long-runner", ["import time\ntime.sleep(600)"])
    kaggle_api.kernels_push(str(tmp_path / "k"))
    # The CLI subprocess inherits the emulator's env from the fixture.
    kernels = subprocess.run([str(KAGGLE_CLI), "kernels", "list", "--mine"], capture_output=True, text=True, timeout=PATIENCE_S)
    assert kernels.returncode == 0, kernels.stderr
    assert "alice/long-runner" in kernels.stdout
    datasets = subprocess.run([str(KAGGLE_CLI), "datasets", "list", "--mine"], capture_output=True, text=True,
                              timeout=PATIENCE_S)
    assert datasets.returncode == 0, datasets.stderr
    assert "alice/listed-data" in datasets.stdout

    def cancel(session_id: int):
        request = ApiCancelKernelSessionRequest()
        request.kernel_session_id = session_id
        with kaggle_api.build_kaggle_client() as kaggle:
            return kaggle.kernels.kernels_api_client.cancel_kernel_session(request)

    with pytest.raises(requests.HTTPError) as info:
        cancel(1)  # the version number is not a session id (Kaggle exposes no session id)
    assert info.value.response is not None and info.value.response.status_code == 403
    session_id = int(emulator.session("alice/long-runner")["id"])
    assert cancel(session_id).error_message == ""
    session = emulator.wait_session("alice/long-runner")
    assert session["status"] == "CANCEL_ACKNOWLEDGED"
    assert kaggle_api.kernels_status("alice/long-runner").status.name == "CANCEL_ACKNOWLEDGED"
    assert "not running" in cancel(session_id).error_message
    [record] = emulator.cancellations()
    assert record["by"] == "api" and record["kernel"] == "alice/long-runner" and record["version"] == 1

    kaggle_api.kernels_push(str(tmp_path / "k"))
    emulator.cancel("alice/long-runner")  # the user stopped it in the web UI
    assert emulator.wait_session("alice/long-runner", 2)["status"] == "CANCEL_ACKNOWLEDGED"
    assert [c["by"] for c in emulator.cancellations()] == ["api", "web UI"]


def context(args: list[str]):
    """`kchain emulator serve ARGS` parsed, not run, with the CLI's help names: click 8.2 keeps the first
    help option a command makes, so a context without `-h` would take `-h` away for later tests."""
    return serve_command.make_context("serve", args, help_option_names=["-h", "--help"])


def serve_options(*args: str) -> dict:
    """The Emulator(...) options `kchain emulator serve ARGS` would start with (parsed, not run)."""
    params = context(["--state", "x", *args]).params
    given = {k: v for k, v in params.items() if v is not None and k not in
             ("state_dir", "port", "users", "tokens", "secrets", "attached", "competitions", "lenient")}
    return emulator_options(params["lenient"], **given)


def test_every_switch_limit_and_fault_is_a_serve_option():
    options = {p.name for p in serve_command.params}
    assert set(Switches().describe()) <= options and {"session_limit_s", "gpu_quota_s", "max_gpu_sessions"} <= options
    faults = {f.name for f in dataclasses.fields(Faults) if f.init} - {"no_gpu"}  # a test-only fault
    assert faults <= options
    chosen = serve_options("--missing-status", "404", "--no-ignore-version-pin")["switches"]
    assert chosen.missing_status == 404 and chosen.ignore_version_pin is False and chosen.queue_s == 1.0
    assert serve_options("--lenient", "--queue", "2")["switches"] == Switches.lenient(queue_s=2.0)
    unset = serve_options()  # nothing given: the emulator's own defaults
    assert sorted(unset) == ["faults", "switches"] and unset["switches"] == Switches()
    assert repr(unset["faults"]) == repr(Faults())  # (Faults compares by its lock too)
    started = serve_options("--session-limit", "60", "--kill-random", "1", "2", "--lose-output")
    assert started["session_limit_s"] == 60.0 and started["faults"].kill_random_s == (1.0, 2.0)
    assert started["faults"].lose_output is True and Limits().session_limit_s == 12 * 3600
    # What `push --unattended` needs outside Python tests: Secrets attached to the job's kernel and its relay.
    attached = context(["--state", "x", "--attach-secret", "alice/job", "--attach-secret", "alice/job-doctor",
                        "--no-secrets-reset-on-push"]).params
    assert attached["attached"] == ("alice/job", "alice/job-doctor") and attached["secrets_reset_on_push"] is False


def test_stream_threads_end_with_the_emulator(emulator, kaggle_api, tmp_path):
    write_kernel(tmp_path / "k", "alice/forever", ["import time\nprint('up', flush=True)\ntime.sleep(600)"])
    kaggle_api.kernels_push(str(tmp_path / "k"))
    seen = threading.Event()

    def follow() -> None:
        for event in kaggle_api.kernels_logs_stream("alice/forever"):
            if "up" in event["data"]:
                seen.set()

    reader = threading.Thread(target=follow, daemon=True)
    reader.start()
    assert seen.wait(60)
    emulator.stop()  # a follower must not keep the emulator (or the test) alive
    reader.join(30)
    assert not reader.is_alive()


def test_kchain_emulator_serve_help_has_an_example_and_says_what_each_option_does():
    result = invoke("emulator", "serve", "--help")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("Usage: cli emulator serve [OPTIONS]")
    assert "\n  Example:\n    kchain emulator serve --state /tmp/kaggle --session-limit 60\n" in result.output
    for param in serve_command.params:
        assert param.help, param.name
        assert param.opts[0] in result.output
    help_text = " ".join(result.output.split())  # unwrapped
    assert "--missing-status [403|404] Switch: the answer for a missing or invisible kernel or dataset. " \
           "[default: 403]" in help_text  # the default, read from Switches
    assert "[default: 43200]" in help_text and "[default: no-quota-has-gpu]" in help_text


def test_kchain_emulator_serve_on_a_taken_port_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = invoke("emulator", "serve", "--state", tmp_path / "kaggle", "--port", port)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.output.splitlines() == [
        f"Error: port {port} on 127.0.0.1 is in use (another emulator?); pass another --port, or --port 0 for a free one"]


def test_kchain_emulator_serve_refuses_a_malformed_pair():
    result = invoke("emulator", "serve", "--state", "x", "--user", "alice")
    assert result.exit_code == 2
    assert error_line(result) == "Error: Invalid value for '--user': 'alice': write it as NAME:KEY"


@pytest.mark.parametrize("option, value, says", [
    ("--mount-lag", "-1", "Error: --mount-lag is 0 (mounted once ready) or a number of seconds"),
    ("--refuse-save", "429,x", "Error: --refuse-save is HTTP error codes separated by commas (429,500), not '429,x'"),
])
def test_kchain_emulator_serve_names_the_option_a_switch_or_fault_refuses(tmp_path, option, value, says):
    result = invoke("emulator", "serve", "--state", tmp_path / "kaggle", option, value)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert error_line(result) == says
    assert not (tmp_path / "kaggle").exists()  # refused before anything was made


def test_switches_refuse_values_kaggle_never_answers():
    with pytest.raises(ValueError, match="403 or 404"):
        Switches(missing_status=500)
    with pytest.raises(ValueError, match="'kept' or 'lost'"):
        Switches(output_at_limit="sometimes")
