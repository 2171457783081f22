"""TRM's components, each against its definition (the paper and the reference code): stablemax CE, the halting
target and loss, the H-1 cycles without gradient, the carry reset and halting rule, the sparse sign-SGD of the
puzzle embeddings, AdamATan2, the EMA, and the train step on a mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harvest.errors import UserError
from harvest.trm import model as trm_model
from harvest.trm.carry import empty_carry, halt, reset
from harvest.trm.hparams import PRESETS, TrmConfig, TrmOptim, preset
from harvest.trm.layers import rope_tables
from harvest.trm.loss import act_loss, halt_bce, halt_target, stablemax_cross_entropy
from harvest.trm.optim import adam_atan2, ema_update, sparse_sign_sgd

TINY = TrmConfig(vocab_size=7, seq_len=6, num_puzzle_identifiers=5, hidden=16, heads=2, expansion=2.0,
                 H_cycles=3, L_cycles=2, halt_max_steps=4, puzzle_emb_ndim=16, puzzle_emb_len=2).validate()


def _batch(cfg, b, seed):
    gen = np.random.default_rng(seed)
    return {"inputs": gen.integers(1, cfg.vocab_size, (b, cfg.seq_len)).astype(np.uint8),
            "labels": gen.integers(1, cfg.vocab_size, (b, cfg.seq_len)).astype(np.uint8),
            "puzzle_identifiers": gen.integers(0, cfg.num_puzzle_identifiers, b).astype(np.int32)}


def test_stablemax_cross_entropy_is_its_formula():
    gen = np.random.default_rng(0)
    logits = gen.normal(0, 3, (3, 4, 5))
    labels = gen.integers(0, 5, (3, 4))
    mask = gen.random((3, 4)) < 0.8
    s = np.where(logits < 0, 1 / (1 - logits), logits + 1)
    want = -np.log(np.take_along_axis(s / s.sum(-1, keepdims=True), labels[..., None], -1)[..., 0])
    got = stablemax_cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(labels), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), np.where(mask, want, 0.0), rtol=1e-5, atol=1e-6)
    # Finite gradients, also for large logits (the untaken branch of s must not poison them).
    g = jax.grad(lambda x: stablemax_cross_entropy(x, jnp.asarray(labels), jnp.asarray(mask)).sum())(
        jnp.asarray(logits * 100, jnp.float32))
    assert np.all(np.isfinite(np.asarray(g)))


def test_halting_target_and_loss():
    # Sample 0: all counted positions right (the wrong one is ignored); sample 1: one counted position wrong.
    labels = jnp.array([[2, 3, 0], [2, 3, 4]])
    preds = np.array([[2, 3, 5], [2, 1, 4]])
    logits = jax.nn.one_hot(preds, 6) * 10.0
    mask = labels != 0
    np.testing.assert_array_equal(np.asarray(halt_target(logits, labels, mask)), [True, False])
    q = jnp.array([0.7, -1.3])
    t = np.array([1.0, 0.0])
    sig = 1 / (1 + np.exp(-np.asarray(q, np.float64)))
    np.testing.assert_allclose(np.asarray(halt_bce(q, jnp.array([True, False]))),
                               -(t * np.log(sig) + (1 - t) * np.log(1 - sig)), rtol=1e-6)
    # The whole loss: per sample mean token CE over counted positions, summed, + 0.5 x summed BCE.
    total, parts = act_loss(logits, q, labels, ignore_label_id=0)
    ce = np.asarray(stablemax_cross_entropy(logits, labels, mask)).sum(-1) / np.array([2, 3])
    np.testing.assert_allclose(float(parts["lm_loss"]), ce.sum(), rtol=1e-6)
    np.testing.assert_allclose(float(total), ce.sum() + 0.5 * np.asarray(halt_bce(q, parts["correct"])).sum(),
                               rtol=1e-6)


def test_no_gradient_through_the_first_h_minus_1_cycles():
    """The step's gradient equals a hand-unrolled one where the first H-1 cycles run outside the
    differentiated function (plain values), and differs from backpropagating through every cycle. (The Sudoku
    variant here; the attention block runs in the train-step test.)"""
    cfg = dataclasses.replace(TINY, L_layers=1, mlp_t=True, pos_encodings="learned")
    params = trm_model.init_params(cfg, jax.random.key(1))
    params["q_head"]["w"] = jax.random.normal(jax.random.key(2), params["q_head"]["w"].shape) * 0.1
    batch = _batch(cfg, 3, 0)
    rows = jax.random.normal(jax.random.key(3), (3, cfg.puzzle_emb_ndim))
    states = trm_model.init_states(cfg, jax.random.key(4))
    y0 = jnp.broadcast_to(states["y"], (3, cfg.total_len, cfg.hidden))
    z0 = jnp.broadcast_to(states["z"], (3, cfg.total_len, cfg.hidden))
    rope = rope_tables(cfg)

    def loss_of(logits, q):
        return act_loss(logits, q, jnp.asarray(batch["labels"]), 0)[0]

    def step_loss(p, r):
        _, logits, q = trm_model.forward(cfg, p, r, batch["inputs"], y0, z0)
        return loss_of(logits, q)

    @jax.jit
    def first_cycles(p, r):  # outside any differentiation
        x = trm_model.embed(cfg, p, batch["inputs"], r)
        y, z = y0, z0
        for _ in range(cfg.H_cycles - 1):
            for _ in range(cfg.L_cycles):
                z = trm_model.net(cfg, p, z, y + x, rope)
            y = trm_model.net(cfg, p, y, z, rope)
        return y, z

    y, z = first_cycles(params, rows)

    def last_cycle_loss(p, r):
        xp = trm_model.embed(cfg, p, batch["inputs"], r)
        zz = z
        for _ in range(cfg.L_cycles):
            zz = trm_model.net(cfg, p, zz, y + xp, rope)
        return loss_of(*trm_model.heads(cfg, p, trm_model.net(cfg, p, y, zz, rope)))

    def all_cycles_loss(p, r):
        xp = trm_model.embed(cfg, p, batch["inputs"], r)
        yy, zz = y0, z0
        for _ in range(cfg.H_cycles):
            for _ in range(cfg.L_cycles):
                zz = trm_model.net(cfg, p, zz, yy + xp, rope)
            yy = trm_model.net(cfg, p, yy, zz, rope)
        return loss_of(*trm_model.heads(cfg, p, yy))

    (value, got), (want_value, want), through = [
        jax.jit(f)(params, rows) for f in (jax.value_and_grad(step_loss, argnums=(0, 1)),
                                           jax.value_and_grad(last_cycle_loss, argnums=(0, 1)),
                                           jax.grad(all_cycles_loss, argnums=(0, 1)))]
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=2e-5)
    far = max(float(jnp.max(jnp.abs(g - t))) for g, t in zip(jax.tree.leaves(got), jax.tree.leaves(through)))
    assert far > 1e-4, "the full backpropagation gives the same gradient: the test could not fail"


def test_carry_reset_on_halt_and_the_halting_rule():
    states = trm_model.init_states(TINY, jax.random.key(0))
    old = {**empty_carry(TINY, 4), **{k: jnp.asarray(v) for k, v in _batch(TINY, 4, 1).items()}}
    old["y"] = old["y"] + 3.0
    old["z"] = old["z"] - 2.0
    old["steps"] = jnp.array([2, 4, 1, 3], jnp.int32)
    old["halted"] = jnp.array([False, True, False, True])
    new_batch = _batch(TINY, 4, 2)
    got = reset(old, new_batch, states)
    for i, halted in enumerate([False, True, False, True]):
        source = new_batch if halted else {k: np.asarray(old[k]) for k in new_batch}
        for k in new_batch:
            np.testing.assert_array_equal(np.asarray(got[k][i]), np.asarray(source[k][i]))
        np.testing.assert_array_equal(np.asarray(got["y"][i]),
                                      np.broadcast_to(states["y"], got["y"][i].shape) if halted else old["y"][i])
        np.testing.assert_array_equal(np.asarray(got["z"][i]),
                                      np.broadcast_to(states["z"], got["z"][i].shape) if halted else old["z"][i])
    np.testing.assert_array_equal(np.asarray(got["steps"]), [2, 0, 1, 0])

    steps = jnp.array([1, 2, 3, 4])
    q = jnp.array([1.0, -1.0, 1.0, -1.0])
    # Evaluation (no key): only at halt_max_steps, whatever the Q head says.
    np.testing.assert_array_equal(np.asarray(halt(TINY, steps, q, None)), [False, False, False, True])
    # Training without exploration: Q head says halt (q > 0) or the limit.
    calm = dataclasses.replace(TINY, halt_exploration_prob=0.0)
    np.testing.assert_array_equal(np.asarray(halt(calm, steps, q, jax.random.key(0))), [True, False, True, True])
    # Always exploring: a sample runs at least 2 steps (its random minimum is 2..halt_max_steps).
    eager = dataclasses.replace(TINY, halt_exploration_prob=1.0)
    many = jnp.ones((2000,), jnp.int32)
    assert not np.any(np.asarray(halt(eager, many, jnp.ones(2000), jax.random.key(1))))
    at = [np.asarray(halt(eager, many * s, jnp.ones(2000), jax.random.key(1))).mean() for s in (2, 3, 4)]
    np.testing.assert_allclose(at, [1 / 3, 2 / 3, 1.0], atol=0.05)


def test_sparse_sign_sgd_moves_only_the_batch_rows():
    gen = np.random.default_rng(0)
    table = gen.normal(size=(6, 4)).astype(np.float32)
    ids = np.array([4, 1, 4, 0], np.int32)
    grads = gen.normal(size=(4, 4)).astype(np.float32)
    grads[1, 2] = 0.0  # sign(0) = 0: only the decay moves it
    lr, wd = 0.01, 0.5
    got = np.asarray(sparse_sign_sgd(jnp.asarray(table), jnp.asarray(ids), jnp.asarray(grads), lr, wd))
    want = table.copy()
    for i in np.unique(ids):
        summed = grads[ids == i].sum(0)
        want[i] = table[i] * (1 - lr * wd) - lr * np.sign(summed)
    np.testing.assert_array_equal(got[[2, 3, 5]], table[[2, 3, 5]])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    # The summed row gradients are the gradient of the table itself.
    dense = jax.grad(lambda t: jnp.sum(t[ids] * grads))(jnp.asarray(table))
    np.testing.assert_allclose(np.asarray(dense)[ids], np.stack([grads[ids == i].sum(0) for i in ids]), rtol=1e-6)


def test_adam_atan2_is_its_formula():
    gen = np.random.default_rng(0)
    p = {"a": gen.normal(size=(3, 2)).astype(np.float32), "b": gen.normal(size=(4,)).astype(np.float32)}
    grads = [{k: gen.normal(size=v.shape).astype(np.float32) * 10 ** (i - 1) for k, v in p.items()} for i in range(4)]
    b1, b2, wd = 0.9, 0.95, 0.1
    lr_at = lambda step: 1e-2 * (step + 1) / 4  # noqa: E731
    opt = adam_atan2(lr_at, b1, b2, wd)
    params = jax.tree.map(jnp.asarray, p)
    state = opt.init(params)
    want = {k: v.astype(np.float64) for k, v in p.items()}
    m = {k: np.zeros_like(v) for k, v in want.items()}
    v = {k: np.zeros_like(x) for k, x in want.items()}
    for t, g in enumerate(grads, start=1):
        updates, state = opt.update(jax.tree.map(jnp.asarray, g), state, params)
        params = jax.tree.map(lambda a, u: a + u, params, updates)
        lr = lr_at(t - 1)
        for k in want:
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            want[k] = want[k] * (1 - lr * wd) - lr / (1 - b1 ** t) * np.arctan2(m[k], np.sqrt(v[k] / (1 - b2 ** t)))
    for k in want:
        np.testing.assert_allclose(np.asarray(params[k]), want[k], rtol=1e-5, atol=1e-6)


def test_ema_of_weights():
    a, b = {"w": jnp.array([1.0, 2.0])}, {"w": jnp.array([3.0, -1.0])}
    np.testing.assert_allclose(np.asarray(ema_update(a, b, 0.9)["w"]), [0.9 * 1 + 0.1 * 3, 0.9 * 2 - 0.1], rtol=1e-6)


def test_presets_and_bad_settings():
    assert PRESETS["trm-sudoku-mlp"].published == {"sudoku-extreme": 0.874}
    assert PRESETS["trm-maze"].published == {"maze-hard": 0.853}
    assert PRESETS["trm-arc"].published == {"arc-agi-1": 0.446, "arc-agi-2": 0.078}
    sudoku = preset("trm-sudoku-mlp", H_cycles=2)
    assert sudoku.model.mlp_t and sudoku.model.H_cycles == 2 and sudoku.model.L_cycles == 6
    with pytest.raises(UserError, match="unknown TRM preset 'trm-chess'; choose one of trm-sudoku-mlp"):
        preset("trm-chess")
    with pytest.raises(UserError, match="not a multiple of heads"):
        dataclasses.replace(TINY, heads=3).validate()
    with pytest.raises(UserError, match="--pos-encodings 'alibi'"):
        dataclasses.replace(TINY, pos_encodings="alibi").validate()


def test_train_step_keeps_the_carry_until_halt_and_one_device_equals_eight():
    """Deep supervision: a slot keeps its sample (not the new batch's) until it halts, then takes the next
    batch's; puzzle-embedding rows not in the batch stay as they were; the same steps on 8 devices (batch
    split over `data`) and on 1 give the same state and carry."""
    from harvest.runtime.mesh import make_mesh
    from harvest.trm.step import init_state, make_train_step

    cfg = dataclasses.replace(TINY, H_cycles=2, L_cycles=1, L_layers=1, halt_max_steps=2,
                              halt_exploration_prob=0.0)
    optim = TrmOptim(batch_size=8, warmup=1, lr=1e-3, puzzle_emb_lr=1e-2)
    batches = [_batch(cfg, 8, seed) for seed in range(3)]
    for b in batches:
        b["puzzle_identifiers"] %= 3  # ids 3 and 4 never in a batch
    runs = []
    for mesh in (make_mesh("data=8"), make_mesh("1d", jax.devices()[:1])):
        state = init_state(cfg, optim, 0)
        step = make_train_step(cfg, optim, mesh, state, 8)
        carry = empty_carry(cfg, 8)
        seen = []
        for b in batches:
            state, carry, metrics = step(state, carry, b)
            seen.append((np.asarray(carry["inputs"]), np.asarray(carry["steps"]), int(metrics["count"])))
        runs.append((jax.device_get(state), jax.device_get(carry), seen))
    (state, carry, seen), (state1, carry1, _) = runs
    np.testing.assert_array_equal(seen[0][0], batches[0]["inputs"])
    np.testing.assert_array_equal(seen[1][0], batches[0]["inputs"])  # not halted: batch 1 is not taken
    np.testing.assert_array_equal(seen[2][0], batches[2]["inputs"])  # halted at step 2: batch 2 taken
    assert [s[1].tolist() for s in seen] == [[1] * 8, [2] * 8, [1] * 8] and [s[2] for s in seen] == [0, 8, 0]
    np.testing.assert_array_equal(state["puzzle_emb"][3:], 0.0)
    assert np.all(np.abs(state["puzzle_emb"][:3]) > 0)
    for a, b in zip(jax.tree.leaves((state, carry)), jax.tree.leaves((state1, carry1))):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-6)
