"""Hypothesis strategies for job files, good and bad, and one way to run a job file through render.

Shared by tests/job/test_fuzz_specs.py (a fixed budget in CI) and bench/fuzz_specs.py (thousands).
A generated job file is bytes: a spec built from the real keys with wrong and right values and
dumped as YAML, the same with anchors, aliases, tags or a random edit, or plain junk.
"""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from click.testing import CliRunner
from hypothesis import strategies as st

from kchain.cli import cli

CORPUS = Path(__file__).resolve().parent / "corpus"
TRAIN_PY = "def main(run):\n    pass\n"

KEYS = ["name", "code", "entry", "params", "kaggle", "train", "smoke", "budget"]
SECTIONS = {
    "kaggle": ["owner", "accelerator", "internet", "private", "datasets", "models", "competition", "local"],
    "train": ["checkpoint_every", "keep", "session_limit", "margin", "heartbeat", "precision"],
    "smoke": ["fraction", "steps"],
    "budget": ["weekly_gpu_hours", "slack"],
}

texts = st.text(max_size=40)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-10**30, 10**30),
    st.floats(allow_nan=True, allow_infinity=True), texts,
    st.sampled_from(["", "train.py", "../train.py", "/etc/passwd", "train.py\n", "tinygpt-notes\n", "a" * 300,
                     "10m", "-5m", "0s", "0", "500 steps", "12h", "13h", "1h30m", "gpu", "tpu", "none",
                     "alice/notes-data", "alice/notes-data/3", "Alice/x", "a--b", "train:main", "train:main\n",
                     "2024-01-01", "\x00", "\ud800", "é", "tinygpt-notes"]),
    st.dates(), st.binary(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=12,
)


# Right values for each field, so that a good share of the specs get as far as rendering.
GOOD: dict[str, list[Any]] = {
    "entry": ["train:main"], "params": [{}, {"lr": 0.001, "steps": 10}, {"nested": {"a": [1, 2.5, None, "x"]}}],
    "owner": ["alice", "bob_2", None], "accelerator": ["gpu", "none"], "internet": [True, False],
    "private": [True, False], "datasets": [[], ["carol/delivery-notes"], ["carol/delivery-notes/2"]],
    "models": [[], ["google/gemma/transformers/2b/1"]], "competition": [None, "titanic"], "local": [{}],
    "checkpoint_every": ["10m", "500 steps", 20, 1.5], "keep": [1, 2, 20], "session_limit": ["12h", "2h", 3600],
    "margin": ["15m", 60, "1m30s"], "heartbeat": ["60s", "0s", 5], "precision": ["auto", "fp32", "bf16"],
    "fraction": [0.02, 1], "steps": [1, 2, 50], "weekly_gpu_hours": [30, 0.5], "slack": [None, 0, 6.5],
}


def field_values(field: str) -> st.SearchStrategy:
    good = GOOD.get(field)
    if not good:
        return values
    return mostly(st.sampled_from(good), values)


def mostly(right: st.SearchStrategy, wrong: st.SearchStrategy) -> st.SearchStrategy:
    """Right nine times in ten, so that a spec with one bad field is the usual case."""
    return st.integers(0, 9).flatmap(lambda i: wrong if i == 0 else right)


@st.composite
def spec_dicts(draw: st.DrawFn) -> dict:
    """A job as data: usually name and code right, any of the other keys with any value."""
    spec: dict = {}
    if draw(st.integers(0, 9)):
        spec["name"] = draw(mostly(st.just("tinygpt-notes"), st.one_of(texts, values)))
    if draw(st.integers(0, 9)):
        spec["code"] = draw(mostly(st.sampled_from(["train.py", "."]), st.one_of(texts, values)))
    for key in draw(st.lists(st.sampled_from(KEYS[2:]), max_size=3, unique=True)):
        fields = SECTIONS.get(key)
        if fields and draw(st.integers(0, 9)):
            chosen = draw(st.lists(st.sampled_from(fields), max_size=3, unique=True))
            spec[key] = {f: draw(field_values(f)) for f in chosen}
        else:
            spec[key] = draw(field_values(key))
    if draw(st.integers(0, 9)) == 0:
        spec[draw(texts)] = draw(values)  # an unknown key
    return spec


def dump(spec: dict, flow: bool | None) -> str:
    return yaml.dump(spec, default_flow_style=flow, allow_unicode=True, sort_keys=False)


ANCHORED = """\
name: tinygpt-notes
code: train.py
params:
  base: &b {lr: 0.001, steps: {inner}}
  other: {ref}
"""


@st.composite
def job_files(draw: st.DrawFn) -> bytes:
    """The bytes of a job.yaml, from plausible to hostile."""
    kind = draw(st.sampled_from(["spec", "spec", "spec", "anchors", "edited", "text", "binary", "encoded"]))
    if kind == "text":
        return draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")
    if kind == "binary":
        return draw(st.binary(max_size=200))
    if kind == "anchors":
        inner = draw(st.sampled_from(["10", "*b", "[*b, *b]", "!!set {a}", "!!binary aGk=", "2024-01-01"]))
        ref = draw(st.sampled_from(["*b", "{<<: *b, steps: 2}", "[*b, *b, *b]", "&c [*c]", "{<<: [*b, *b]}"]))
        return ANCHORED.replace("{inner}", inner).replace("{ref}", ref).encode()
    try:
        text = dump(draw(spec_dicts()), draw(st.sampled_from([None, True, False])))
    except (yaml.YAMLError, UnicodeError, ValueError):  # a value PyYAML cannot write
        text = "name: tinygpt-notes\ncode: train.py\n"
    if kind == "edited" and text:
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 5))
        text = text[:at] + draw(st.text(max_size=6)) + text[at + cut:]
    data = text.encode("utf-8", "surrogatepass")
    if kind == "encoded":
        data = text.encode(draw(st.sampled_from(["utf-16", "utf-32", "latin-1", "cp1252"])), "replace")
    return data


@dataclass
class Outcome:
    exit_code: int
    seconds: float
    error_lines: list[str]
    traceback: str | None
    output: str


def render_bytes(folder: Path, data: bytes) -> Outcome:
    """Write job.yaml (with a valid train.py beside it) and run `kchain render` on it in-process."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.py").write_text(TRAIN_PY)
    job = folder / "job.yaml"
    job.write_bytes(data)
    started = time.perf_counter()
    result = CliRunner().invoke(cli, ["render", str(job), "-o", str(folder / "out")])
    seconds = time.perf_counter() - started
    tb = None
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        tb = "".join(traceback.format_exception(result.exception))
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    return Outcome(result.exit_code, seconds, errors, tb, result.output)


def problem(outcome: Outcome) -> str | None:
    """Why an outcome breaks the rule (exit 0, or exit 10 (a job file error) with exactly one `Error:` line), or None."""
    if outcome.traceback:
        return f"traceback:\n{outcome.traceback}"
    if outcome.exit_code == 0:
        return None if not outcome.error_lines else f"exit 0 with an error: {outcome.output}"
    if outcome.exit_code != 10:
        return f"exit {outcome.exit_code}: {outcome.output}"
    if len(outcome.error_lines) != 1 or "Traceback" in outcome.output:
        return f"not one Error: line: {outcome.output!r}"
    if len(outcome.error_lines[0]) > 2000:
        return f"an error of {len(outcome.error_lines[0])} characters"
    return None


def corpus() -> dict[str, dict]:
    return json.loads((CORPUS / "expected.json").read_text())

