"""Multi-host start-up: how settings are resolved, and a real 2-process x 4-device run on CPU."""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from processes import CLUSTER_ENV, free_port, pod_env

from harvest.errors import UserError
from harvest.runtime import distributed as D
from harvest.runtime.distributed import Settings, resolve

HERE = Path(__file__).resolve().parents[1]  # the workers live beside the shared helpers, in tests/


@pytest.fixture
def clean_env(monkeypatch):
    for var in (*D.ENV.values(), *CLUSTER_ENV):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def no_cluster():
    return None


ENV2 = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_PROCESS_COUNT": "4", "JAX_PROCESS_INDEX": "3"}


def test_nothing_set_is_one_process():
    assert resolve(env={}, detect=no_cluster) == Settings()
    assert not Settings().multi


def test_arguments_then_env_field_by_field():
    assert resolve("h:1", 2, 1, env={}, detect=no_cluster) == Settings("h:1", 2, 1)
    assert resolve(env=ENV2, detect=no_cluster) == Settings("10.0.0.1:1234", 4, 3)
    assert resolve("h:1", 2, 1, env=ENV2, detect=no_cluster) == Settings("h:1", 2, 1)
    assert resolve("h:1", env=ENV2, detect=no_cluster) == Settings("h:1", 4, 3)
    assert resolve(process_id=0, env=ENV2, detect=no_cluster) == Settings("10.0.0.1:1234", 4, 0)


def test_cluster_detection_only_when_nothing_is_set():
    assert resolve(env={}, detect=lambda: "slurm") == Settings(cluster="slurm")
    assert resolve(env={}, detect=lambda: "slurm").multi
    assert resolve(env=ENV2, detect=lambda: "slurm") == Settings("10.0.0.1:1234", 4, 3)
    with pytest.raises(UserError, match="missing"):
        resolve("h:1", env={}, detect=lambda: "slurm")


@pytest.mark.parametrize("args,env,needs", [
    (("h:1",), {}, ["process count (--num-processes or JAX_PROCESS_COUNT)",
                    "process id (--process-id or JAX_PROCESS_INDEX)"]),
    ((None, 2), {}, ["coordinator address (--coordinator or JAX_COORDINATOR_ADDRESS)", "process id"]),
    ((), {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_COUNT": "2"}, ["missing process id", "JAX_PROCESS_INDEX"]),
    ((), {"JAX_PROCESS_INDEX": "1"}, ["missing coordinator address", "process count"]),
])
def test_partial_settings_name_what_is_missing(args, env, needs):
    with pytest.raises(UserError) as e:
        resolve(*args, env=env, detect=no_cluster)
    message = str(e.value)
    assert "\n" not in message and message.startswith("multi-host settings incomplete")
    for need in needs:
        assert need in message


@pytest.mark.parametrize("args,env,match", [
    ((), {**ENV2, "JAX_PROCESS_COUNT": "two"}, "JAX_PROCESS_COUNT='two': expected an integer"),
    (("h:1", 2, 2), {}, "process id 2 with 2 processes"),
    (("h:1", 2, -1), {}, "process id -1"),
    (("h:1", 0, 0), {}, "process id 0 with 0 processes"),
    (("nohost", 2, 0), {}, "expected HOST:PORT"),
])
def test_bad_settings(args, env, match):
    with pytest.raises(UserError, match=match):
        resolve(*args, env=env, detect=no_cluster)


def test_one_process_needs_no_coordinator():
    assert resolve(num_processes=1, env={}, detect=no_cluster) == Settings()
    assert resolve("h:1", 1, 0, env={}, detect=no_cluster) == Settings()


SLURM = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[001-002]", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}


def test_detects_multi_task_slurm_with_jax_detectors(clean_env):
    assert D.detect_cluster() is None
    for var, value in SLURM.items():
        clean_env.setenv(var, value)
    clean_env.setenv("SLURM_NTASKS", "1")
    assert D.detect_cluster() is None  # a one-task job is one process
    clean_env.setenv("SLURM_NTASKS", "2")
    assert D.detect_cluster() == "slurm"
    assert resolve() == Settings(cluster="slurm")


def test_kubernetes_alone_is_not_a_cluster(clean_env):
    clean_env.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert D.detect_cluster() is None


def test_initialize_one_process_is_a_no_op(clean_env):
    import jax

    info = D.initialize()
    assert info == D.initialize()
    assert (info.process_index, info.process_count, info.coordinator) == (0, 1, None)
    assert info.device_count == info.local_device_count == jax.device_count()
    assert not jax.distributed.is_initialized()


def test_initialize_partial_settings_fail_before_touching_jax(clean_env):
    clean_env.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    with pytest.raises(UserError, match="missing process count"):
        D.initialize()


def test_initialize_after_a_jax_computation_is_a_clear_error(clean_env):
    import jax

    jax.devices()  # the backend exists now, so JAX refuses to join before trying to connect
    with pytest.raises(UserError, match="cannot join the run as process 1 of 2 via 127.0.0.1:1: .*before any JAX"):
        D.initialize("127.0.0.1:1", 2, 1)
    assert not jax.distributed.is_initialized()


def test_stop_agreement_checks_where_the_earliest_proposal_says(monkeypatch):
    """Two processes (the other one's rows faked): each check sends (notice, the step a second of steps ahead at
    its own pace, on CPU at most CPU_MOST_AHEAD steps); the next check is the earliest proposal; a notice on
    either stops. The first checks come a step apart: no pace yet, then the compile's."""
    import types

    import jax
    from jax.experimental import multihost_utils

    clock, sent = [0.0], []
    others = iter([(0, 12), (0, 13), (0, 20), (0, 35), (0, 99), (1, 99)])  # the other process's (notice, next check)

    def allgather(mine: np.ndarray) -> np.ndarray:
        sent.append(mine.tolist())
        return np.stack([mine, np.asarray(next(others), np.int32)])

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    monkeypatch.setattr(D, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    agreement, checked = D.StopAgreement(10, 1000, every_s=1.0), []
    for step in range(11, 100):
        clock[0] += 5.0 if step == 11 else 0.1 if step <= 20 else 0.02  # the compile, 100 ms a step, then 20
        if agreement.due(step):
            checked.append(step)
            if agreement.stop(step, False):
                break
    assert checked == [11, 12, 13, 20, 30, 40]
    assert D.CPU_MOST_AHEAD == 16 and jax.default_backend() == "cpu"
    # each at the pace between the two checks before: 13 + 1 s / 100 ms; at 40, 40 + 16, not 40 + 1 s / 20 ms
    assert sent == [[0, 12], [0, 13], [0, 23], [0, 30], [0, 40], [0, 56]]

    monkeypatch.setattr(jax, "process_count", lambda: 1)
    one = D.StopAgreement(0, 10)  # checks every step, with no collective (allgather would fail: others is spent)
    assert all(one.due(step) for step in range(1, 11)) and one.stop(1, True) and not one.stop(2, False)


# --- a real run: 2 processes x 4 CPU devices against the unsharded forward in this process ---------------

MESHES = "2d,1d,3d"
# qwen3 with widths 8 divides (heads, mlp, vocab: model=8 really shards) and llama's odd ones (mostly replicated).
CHECKPOINTS = {"qwen3": dict(overrides={"num_attention_heads": 8, "intermediate_size": 96, "vocab_size": 216}),
               "llama": {}}


def run_workers(out: Path, ckpts: dict[str, Path], timeout_s: float = 180) -> None:
    env = pod_env(4)
    args = [f"127.0.0.1:{free_port()}", "2"]
    procs, logs = [], []
    for pid in range(2):
        log = open(out / f"worker{pid}.log", "w+")
        cmd = [sys.executable, str(HERE / "multihost_worker.py"), *args, str(pid), str(out), MESHES,
               *(f"{name}={path}" for name, path in ckpts.items())]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        hung = [p for p in procs if p.poll() is None]
        for p in hung:
            p.kill()
            p.wait()
    failed = hung or any(p.returncode for p in procs)
    if failed:
        for pid, log in enumerate(logs):
            log.seek(0)
            print(f"----- worker {pid} (exit {procs[pid].returncode}) -----\n{log.read()[-6000:]}", file=sys.stderr)
    for log in logs:
        log.close()
    assert not hung, f"workers still running after {timeout_s}s (killed); output above"
    assert not failed, f"workers failed with exit codes {[p.returncode for p in procs]}; output above"


@pytest.mark.slow
def test_two_processes_match_the_unsharded_forward(tmp_path):
    import hf_reference
    import jax
    import jax.numpy as jnp
    from multihost_worker import batch
    from safetensors.numpy import load_file

    from harvest.model.config import ModelConfig
    from harvest.model.points import POINTS, CapturePlan
    from harvest.model.transformer import forward
    from harvest.model.weights import load_params

    ckpts = {name: hf_reference.build_checkpoint(name, tmp_path / name, **kw) for name, kw in CHECKPOINTS.items()}
    out = tmp_path / "out"
    out.mkdir()
    run_workers(out, ckpts)

    for pid in range(2):
        info = json.loads((out / f"info.{pid}.json").read_text())
        assert info["info"] == info["again"] == {"process_index": pid, "process_count": 2, "local_device_count": 4,
                                                 "device_count": 8, "coordinator": info["info"]["coordinator"]}
        assert info["info"]["coordinator"].startswith("127.0.0.1:")

    tokens, segments = batch()
    fwd = jax.jit(forward, static_argnames=("cfg", "plan", "constrain"))
    for name, path in ckpts.items():
        cfg = ModelConfig.from_dir(path)
        plan = CapturePlan(tuple((p, tuple(range(cfg.num_layers))) for p in POINTS))
        want = fwd(load_params(path, cfg), jnp.asarray(tokens), jnp.asarray(segments), cfg=cfg, plan=plan)
        for spec in MESHES.split(","):
            got = load_file(out / f"{name}.{spec}.safetensors")
            assert set(got) == set(want)
            for point, ref in want.items():
                ref = np.asarray(ref)
                assert got[point].shape == ref.shape
                scale = float(np.max(np.abs(ref)))
                np.testing.assert_allclose(got[point], ref, rtol=1e-5, atol=1e-5 * scale,
                                           err_msg=f"{name} mesh {spec} {point}")
