"""A `harvest sae train` run SIGKILLed, then SIGTERMed (exit 75), resumes to the params of the run never
interrupted (tests/sae/conftest.py's `straight`); so does one checkpointing into gs:// or s3://, rerun on a
machine with an empty cache."""

from __future__ import annotations

import os

import pytest
from preemption import kill_hold_resume, preempt, resume
from sae_helpers import STEPS, train_args
from training_helpers import assert_trees_close, metrics, restored_params


def test_killed_and_preempted_runs_resume_to_the_uninterrupted_params(sae_source, straight, tmp_path):
    """SIGKILL at a random step, then the same command held at STEPS-1 and SIGTERMed (exit 75, a checkpoint
    at STEPS-1), then the same command to the end: the params equal the straight run's (1e-6)."""
    out = str(tmp_path / "run")
    kill_hold_resume(train_args(sae_source, out), sae_source["env"], STEPS)
    assert_trees_close(restored_params(out), restored_params(straight), rtol=1e-6)
    records = metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {"fvu", "l0", "dead_fraction", "aux_loss", "tokens_per_s"} <= set(records[-1])


@pytest.mark.parametrize("bucket", ["gcs_url", "s3_url"])
def test_checkpoints_in_a_bucket_resume_on_a_fresh_machine(bucket, sae_source, straight, tmp_path, request):
    """SIGTERMed at step 5 with --out in a bucket, then rerun on a "machine" with an empty cache (no staging):
    it resumes from the bucket to the straight run's params."""
    url = request.getfixturevalue(bucket)
    servers = {k: v for k, v in os.environ.items() if k not in sae_source["env"]}  # the emulators' endpoints
    env = {**sae_source["env"], **servers}
    preempt(train_args(sae_source, url), env, hold_at=5)
    resume(train_args(sae_source, url), {**env, "HARVEST_CACHE": str(tmp_path / "another-machine")}, after=5)
    assert_trees_close(restored_params(url), restored_params(straight), rtol=1e-6)
