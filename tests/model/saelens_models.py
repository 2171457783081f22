"""Every model that SAELens's registry of published SAEs (`sae_lens/pretrained_saes.yaml`) names, with its HF
`model_type` (the `model_type` of the checkpoint's config.json, which is what harvest dispatches on) and its hub
id where the registry's name is a TransformerLens alias rather than a hub id.

Written by hand from the models' configs; tests/model/test_saelens_coverage.py fails naming any registry model
missing here. Multimodal checkpoints keep their top-level type: Gemma 3 4B/12B/27B are `gemma3`
(Gemma3ForConditionalGeneration) while 270M and 1B are text-only `gemma3_text`; Qwen3.5 is a hybrid
(Gated DeltaNet + attention) model, `qwen3_5` dense and `qwen3_5_moe` with experts.
"""

from __future__ import annotations

from typing import NamedTuple


class Model(NamedTuple):
    model_type: str
    hub_id: str


MODELS: dict[str, Model] = {
    # Gemma 1
    "gemma-2b": Model("gemma", "google/gemma-2b"),
    "gemma-2b-it": Model("gemma", "google/gemma-2b-it"),
    # Gemma 2
    "gemma-2-2b": Model("gemma2", "google/gemma-2-2b"),
    "gemma-2-9b": Model("gemma2", "google/gemma-2-9b"),
    "gemma-2-9b-it": Model("gemma2", "google/gemma-2-9b-it"),
    "gemma-2-27b": Model("gemma2", "google/gemma-2-27b"),
    # Gemma 3: text-only below 4B, image-text (Gemma3ForConditionalGeneration) from 4B
    "google/gemma-3-270m": Model("gemma3_text", "google/gemma-3-270m"),
    "google/gemma-3-270m-it": Model("gemma3_text", "google/gemma-3-270m-it"),
    "google/gemma-3-1b-pt": Model("gemma3_text", "google/gemma-3-1b-pt"),
    "google/gemma-3-1b-it": Model("gemma3_text", "google/gemma-3-1b-it"),
    "google/gemma-3-4b-pt": Model("gemma3", "google/gemma-3-4b-pt"),
    "google/gemma-3-4b-it": Model("gemma3", "google/gemma-3-4b-it"),
    "google/gemma-3-12b-pt": Model("gemma3", "google/gemma-3-12b-pt"),
    "google/gemma-3-12b-it": Model("gemma3", "google/gemma-3-12b-it"),
    "google/gemma-3-27b-pt": Model("gemma3", "google/gemma-3-27b-pt"),
    "google/gemma-3-27b-it": Model("gemma3", "google/gemma-3-27b-it"),
    # GPT-2, Pythia
    "gpt2-small": Model("gpt2", "openai-community/gpt2"),
    "pythia-70m-deduped": Model("gpt_neox", "EleutherAI/pythia-70m-deduped"),
    # Llama (and Llama-architecture distills)
    "meta-llama/Meta-Llama-3-8B-Instruct": Model("llama", "meta-llama/Meta-Llama-3-8B-Instruct"),
    "meta-llama/Llama-3.1-8B": Model("llama", "meta-llama/Llama-3.1-8B"),
    "meta-llama/Llama-3.1-8B-Instruct": Model("llama", "meta-llama/Llama-3.1-8B-Instruct"),
    "meta-llama/Llama-3.3-70B-Instruct": Model("llama", "meta-llama/Llama-3.3-70B-Instruct"),
    "deepseek-ai/DeepSeek-R1-Distill-Llama-8B": Model("llama", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B"),
    # Mistral
    "mistral-7b": Model("mistral", "mistralai/Mistral-7B-v0.1"),
    # Qwen 2.5
    "Qwen/Qwen2.5-7B-Instruct": Model("qwen2", "Qwen/Qwen2.5-7B-Instruct"),
    # Qwen 3 dense
    "qwen3-0.6b": Model("qwen3", "Qwen/Qwen3-0.6B"),
    "qwen3-1.7b": Model("qwen3", "Qwen/Qwen3-1.7B"),
    "qwen3-4b": Model("qwen3", "Qwen/Qwen3-4B"),
    "qwen3-8b": Model("qwen3", "Qwen/Qwen3-8B"),
    "qwen3-14b": Model("qwen3", "Qwen/Qwen3-14B"),
    "Qwen/Qwen3-1.7B-Base": Model("qwen3", "Qwen/Qwen3-1.7B-Base"),
    "Qwen/Qwen3-8B-Base": Model("qwen3", "Qwen/Qwen3-8B-Base"),
    # Qwen 3 mixture of experts
    "Qwen/Qwen3-30B-A3B-Base": Model("qwen3_moe", "Qwen/Qwen3-30B-A3B-Base"),
    # Qwen 3.5: hybrid linear/full attention, dense and MoE
    "Qwen/Qwen3.5-2B-Base": Model("qwen3_5", "Qwen/Qwen3.5-2B-Base"),
    "Qwen/Qwen3.5-9B-Base": Model("qwen3_5", "Qwen/Qwen3.5-9B-Base"),
    "Qwen/Qwen3.5-27B": Model("qwen3_5", "Qwen/Qwen3.5-27B"),
    "Qwen/Qwen3.5-35B-A3B-Base": Model("qwen3_5_moe", "Qwen/Qwen3.5-35B-A3B-Base"),
    # gpt-oss: mixture of experts
    "openai/gpt-oss-20b": Model("gpt_oss", "openai/gpt-oss-20b"),
}
