"""The untracked state's digest keys: a name as the code writes it survives the key's own dots, and the
run.track keyword that fixes a forgotten object is the name's last identifier."""

from __future__ import annotations

import pytest

from kchain.common import statekeys


@pytest.mark.parametrize("name", ["self.ema", "gens[0]", "state['ema'].shadow", "avg.params"])
def test_a_code_name_comes_back_from_its_key_form_and_holds_no_dot(name):
    key = statekeys.written(name)
    assert "." not in key
    assert statekeys.code_name(key) == name


@pytest.mark.parametrize(("name", "keyword"), [("self.ema", "ema"), ("gens[0]", "gens"), ("state['ema']", "ema"),
                                               ("model", "model"), ("[0]", "state")])
def test_the_track_keyword_is_the_names_last_identifier(name, keyword):
    assert statekeys.track_key(name) == keyword


def test_the_two_prefixes_differ():
    assert statekeys.UNTRACKED != statekeys.EXCLUDED
