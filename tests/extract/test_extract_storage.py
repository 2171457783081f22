"""The same run to gs:// (fake-gcs-server) and s3:// (moto), real servers on 127.0.0.1: it verifies,
reads back, and holds the same bytes as a local run; a server that drops connections costs retries only."""

import json
import threading
import time

import numpy as np
import pytest
from extract_helpers import committed

import harvest
from harvest.config import ExtractConfig
from harvest.demo import demo_checkpoint
from harvest.extract.job import run_extract
from harvest.storage import Storage
from harvest.store.verify import verify


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("storage-run")
    rng = np.random.default_rng(3)
    rows = [{"text": "".join(rng.choice(list("the quick brown fox jumps."), rng.integers(5, 120)))} for _ in range(60)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = demo_checkpoint(root)
    local = root / "local"
    run_extract(config(model, data, local))
    return model, data, local


def config(model, data, out):
    return ExtractConfig(model=str(model), data=str(data), out=str(out), points="resid_post:1-2,mlp_out:0",
                         max_seq_len=64, batch_size=2, shard_size="16KB").validate()


def assert_same_run(remote: str, local):
    report = verify(remote)
    assert report.ok, report.problems
    (ours, leftovers), (theirs, _) = committed(Storage(remote)), committed(Storage(str(local)))
    assert ours.keys() == theirs.keys() and len(ours) > 10
    assert ours == theirs and not leftovers
    back, reference = harvest.open(remote), harvest.open(str(local))
    for sample_id in (0, 31, 59):
        a, b = back.sample(sample_id), reference.sample(sample_id)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        for name in reference.tensors:
            np.testing.assert_array_equal(a.activations[name], b.activations[name])


@pytest.mark.parametrize("url_fixture", ["gcs_url", "s3_url"])
def test_run_to_object_storage_equals_local(setup, url_fixture, request):
    model, data, local = setup
    url = request.getfixturevalue(url_fixture)
    run_extract(config(model, data, url))
    assert_same_run(url, local)


@pytest.mark.parametrize("url_fixture,proxy_fixture", [("gcs_proxy_url", "gcs_proxy"), ("s3_proxy_url", "s3_proxy")])
def test_connections_dropped_mid_run_cost_retries_not_data(setup, url_fixture, proxy_fixture, request, caplog):
    model, data, local = setup
    url, proxy = request.getfixturevalue(url_fixture), request.getfixturevalue(proxy_fixture)
    done = threading.Event()

    def outages():
        while proxy.bytes_up == 0 and not done.is_set():  # wait for the run to start writing
            time.sleep(0.05)
        for _ in range(2):
            if done.wait(0.3):
                return
            proxy.outage(1.0)

    thread = threading.Thread(target=outages, daemon=True)
    thread.start()
    run_extract(config(model, data, url))
    done.set()
    thread.join()
    assert proxy.outages >= 1
    assert_same_run(url, local)
