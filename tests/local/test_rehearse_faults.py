"""`kchain rehearse --faults`: each fault by its short name, and the one line a bad one gets."""

from __future__ import annotations

from helpers import copy_job, error_line, invoke

from kchain.local.rehearse import parse_fault_spec


def test_the_faults_spec_names_every_fault_the_rehearsal_can_inject(tmp_path):
    faults = parse_fault_spec("429=0.15,500=0.1,lost_answer=0.1,reset_after_acting=0.05,drop_upload=0.25", seed=3)
    assert (faults.rate_429, faults.rate_500, faults.rate_lost_answer) == (0.15, 0.1, 0.1)
    assert (faults.rate_reset_after_acting, faults.drop_upload_every, faults.seed) == (0.05, 4, 3)
    result = invoke("rehearse", copy_job("tinygpt", tmp_path), "--faults", "reset=0.1")
    assert result.exit_code == 2  # a usage error, as click's own
    assert error_line(result) == ("Error: --faults 'reset=0.1': write name=rate with name one of 429, 500, lost_answer, "
                                  "reset_after_acting, drop_upload and a rate in [0, 1), e.g. --faults "
                                  "429=0.15,500=0.10,lost_answer=0.1,drop_upload=0.1")
