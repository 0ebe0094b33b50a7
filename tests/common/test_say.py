"""The runtime's `[kchain]` lines: sizes in words, and only rank 0 narrating where several ranks run."""

from __future__ import annotations

import pytest

from kchain.common import say


@pytest.mark.parametrize(("n", "words"), [(0, "0 KB"), (99_999, "100 KB"), (100_000, "0.1 MB"),
                                          (99_999_999, "100.0 MB"), (100_000_000, "0.1 GB"), (38.4e9, "38.4 GB")])
def test_a_size_reads_in_the_unit_that_keeps_it_short(n, words):
    assert say.gb(n) == words


def test_one_rank_says_and_warns_as_kchain(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("RANK", "3")  # a RANK without several ranks is not a rank of many
    say.say("resumed at step 40")
    say.warn("no GPU")
    assert capsys.readouterr().out == "[kchain] resumed at step 40\n[kchain] WARNING: no GPU\n"


def test_of_several_ranks_only_rank_0_says_and_each_warning_names_its_rank(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    say.say("saved step 8")
    say.warn("slow step")
    monkeypatch.setenv("RANK", "0")  # read at each line, not at import (a forked rank imported it earlier)
    say.say("saved step 8")
    assert capsys.readouterr().out == "[kchain rank 1] WARNING: slow step\n[kchain] saved step 8\n"
