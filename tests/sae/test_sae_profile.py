"""--profile's per-step times at the log lines, and the k-th value taken without XLA:CPU's row sort."""

import json
from pathlib import Path


def test_profile_prints_reader_and_step_ms(sae_source, tmp_path, capsys):
    """Every log line (and metrics.jsonl record) says the ms per step spent on the reader and in the step."""
    from harvest.sae.config import SaeConfig
    from harvest.training.run import train

    out = str(tmp_path / "sae")
    train(SaeConfig(run=sae_source["run"], tensors="resid_post.1", out=out, expansion=4, k=8, batch_tokens=64,
                    tokens=64 * 4, warmup=1, log_every=2, profile=True).validate())
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all(" ms/step, step " in line for line in lines), lines
    records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    assert all(r["reader_ms"] > 0 and r["step_ms"] > 0 for r in records)


def test_kth_value_is_top_ks_last():
    """topk.kth_value (the k-th value behind a barrier) equals lax.top_k's last value, ties included."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from harvest.sae.topk import kth_value

    x = jnp.round(jax.nn.relu(jax.random.normal(jax.random.key(0), (16, 64))) * 4) / 4  # ties and zeros
    for k in (1, 5, 64):
        np.testing.assert_array_equal(jax.jit(lambda a, k=k: kth_value(a, k))(x), jax.lax.top_k(x, k)[0][:, -1:])
