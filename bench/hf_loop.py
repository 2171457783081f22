"""The plain HF-transformers extraction script users write today, as bench/extract.py measures it: read jsonl,
tokenizer(padding="longest", truncation=True) per batch in file order, fp32 model(..., output_hidden_states=True)
under no_grad, hidden_states[layer + 1] per layer, padding dropped, bf16, safetensors.torch.save_file per batch.
On a GPU host it runs there (--dtype bfloat16 as a GPU user would), the hidden states copied to the host.

Called in-process by bench/extract.py for its pipeline rate, and run as a whole process (`python bench/hf_loop.py
MODEL DATA OUT --layers 3,4,5`) for the start-up-included comparison with `harvest extract`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def extract(model_dir: Path, data: Path, out: Path, layers: list[int], seq: int, batch_size: int,
            attn: str = "sdpa", dtype: str = "float32") -> dict:
    """Run the loop; {"wall", "pipeline" (after the model load), "tokens" (real tokens)}."""
    t0 = time.perf_counter()
    import torch
    import transformers
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=getattr(torch, dtype), attn_implementation=attn).to(device).eval()
    t_loaded = time.perf_counter()
    real = 0
    with data.open() as f:
        lines = f.readlines()
    for b, at in enumerate(range(0, len(lines), batch_size)):
        texts = [json.loads(line)["text"] for line in lines[at : at + batch_size]]
        enc = tokenizer(texts, padding="longest", truncation=True, max_length=seq, return_tensors="pt").to(device)
        with torch.no_grad():
            hidden = model(**enc, output_hidden_states=True).hidden_states
        keep = enc["attention_mask"].bool()
        tensors = {f"resid_post.{layer}": hidden[layer + 1][keep].to(torch.bfloat16).cpu() for layer in layers}
        tensors["input_ids"] = enc["input_ids"][keep].cpu()
        tensors["lengths"] = keep.sum(1).cpu()
        save_file(tensors, str(out / f"batch_{b:06d}.safetensors"))
        real += int(keep.sum())
    t_end = time.perf_counter()
    return {"wall": t_end - t0, "pipeline": t_end - t_loaded, "tokens": real}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("data", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--layers", required=True, help="comma-separated resid_post layers")
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model dtype (default float32)")
    a = p.parse_args()
    done = extract(a.model, a.data, a.out, [int(x) for x in a.layers.split(",")], a.max_seq_len, a.batch_size,
                   a.attn, a.dtype)
    print(json.dumps(done))
