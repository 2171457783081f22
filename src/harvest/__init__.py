"""harvest: activations of open decoder LLMs, extracted at scale into verifiable safetensors shards.

`harvest.open(url)` reads a run back (see harvest.read.Run).
"""


def open(url):  # noqa: A001  (harvest.open is the documented entry point)
    from harvest.read import open_run

    return open_run(url)
