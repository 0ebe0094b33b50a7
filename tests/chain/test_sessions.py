"""The words `kchain status` prints for a chain that waits on the laptop (issue 59 item 6)."""

from __future__ import annotations

from kchain.chain.sessions import waiting


def test_a_laptop_driven_chain_says_plainly_that_the_next_session_waits_for_continue():
    wait = waiting([{"session": 1, "status": "COMPLETE", "summary": None}], "job.yaml")
    assert wait == {"for": "continue", "why": "session 1 ended (complete); the laptop drives this chain, so the "
                                              "next session waits for it"}
