"""Tiny random Hugging Face decoders saved with save_pretrained, for tests (nothing is
downloaded). ``transformers`` is imported lazily so that collecting tests does not need it."""

from pathlib import Path

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text",
                 "mixtral", "qwen2_moe", "qwen3_moe")
# Gemma 2 and 3 as they are, shrunk: local (sliding-window) and global layers alternating,
# their own attention scale (query_pre_attn_scalar), scaled embedding and a final logit
# soft-cap; Gemma 2 also soft-caps its attention scores.
GEMMA3 = dict(sliding_window=6, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
              layer_types=["sliding_attention", "full_attention"] * 2)
# Mixture-of-experts models shrunk: 4 experts, 2 per token, the load-balancing loss in the
# training loss; Qwen2-MoE with its shared expert, unnormalised top-k gates and a dense
# layer among the sparse ones.
EXPERTS = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)


def tiny_config(arch: str, **overrides):
    import transformers

    sizes = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    extra = {"mistral": dict(sliding_window=None), "qwen3": dict(head_dim=8),
             "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
             "gemma2": dict(head_dim=8, pad_token_id=0, attn_logit_softcapping=50.0, **GEMMA3),
             "gemma3_text": dict(head_dim=8, pad_token_id=0, **GEMMA3),
             "mixtral": dict(num_local_experts=4, intermediate_size=48, **EXPERTS),
             "qwen2_moe": dict(num_experts=4, moe_intermediate_size=24, norm_topk_prob=False,
                               shared_expert_intermediate_size=40, mlp_only_layers=[2],
                               **EXPERTS),
             "qwen3_moe": dict(num_experts=4, moe_intermediate_size=24, norm_topk_prob=True,
                               head_dim=8, **EXPERTS)}.get(arch, {})
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                    "phi3": transformers.Phi3Config, "gemma2": transformers.Gemma2Config,
                    "gemma3_text": transformers.Gemma3TextConfig,
                    "mixtral": transformers.MixtralConfig,
                    "qwen2_moe": transformers.Qwen2MoeConfig,
                    "qwen3_moe": transformers.Qwen3MoeConfig}[arch]
    return config_class(**{**sizes, **extra, **overrides})


def save_tiny_model(directory: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A random ``arch`` model of tiny sizes in ``directory`` (config.json + safetensors)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(directory))
    return Path(directory)


# A ChatML chat template (system turns allowed), as Qwen's tokenizers carry.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny_tokenizer(directory: Path, vocab_size: int = 300, chat_template: str = "",
                        extra_special: tuple[str, ...] = ()) -> Path:
    """A byte-level BPE tokenizer of about ``vocab_size`` tokens (any text encodes), with
    BOS/EOS, ChatML's turn markers and ``extra_special`` as special tokens, trained offline
    on a few sentences and saved with save_pretrained (with ``chat_template`` as its chat
    template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|im_start|>", "<|im_end|>", *extra_special]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", *special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20,
                                  trainer=trainer)
    saved = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                    additional_special_tokens=special)
    if chat_template:
        saved.chat_template = chat_template
    saved.save_pretrained(str(directory))
    return Path(directory)


def write_documents(path: Path, count: int = 60, seed: int = 0, max_words: int = 40) -> Path:
    """A .txt of ``count`` documents of 1 to ``max_words`` words, separated by blank lines."""
    import random

    words = "the quick brown fox jumps over a lazy dog while pipelines overlap".split()
    rng = random.Random(seed)
    documents = [" ".join(rng.choice(words) for _ in range(rng.randint(1, max_words))) + "."
                 for _ in range(count)]
    path.write_text("\n\n".join(documents), encoding="utf-8")
    return path


VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                 "<image>")
VISION_ARCHITECTURES = ("qwen2_vl", "qwen2_5_vl", "llava")
# The text each image part of a message becomes, by architecture.
IMAGE_TEXT = {"qwen": "<|vision_start|><|image_pad|><|vision_end|>", "llava": "<image>"}


def vision_chatml(image_text: str) -> str:
    """A ChatML template whose user turns may hold images, as Qwen2-VL's and LLaVA's do."""
    return ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for part in m['content'] %}"
            "{% if part['type'] == 'image' %}" + image_text + "{% else %}{{ part['text'] }}"
            "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_vision_config(arch: str, token_ids: dict[str, int], **overrides):
    """A Qwen2-VL-like config shrunk: a 2-block tower of 4-pixel patches merged 2 x 2, a
    4-layer decoder with 3D rotary sections."""
    import transformers

    text = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=0, eos_token_id=1,
                rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2],
                                     rope_theta=10000.0))
    vision = dict(depth=2, hidden_size=32, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, in_channels=3)
    if arch == "llava":
        return transformers.LlavaConfig(
            text_config=dict(text, model_type="llama", rope_parameters=None),
            vision_config=dict(model_type=overrides.pop("tower", "clip_vision_model"),
                               hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=2, image_size=16, patch_size=4),
            image_token_id=token_ids["<image>"], vision_feature_layer=-2,
            vision_feature_select_strategy=overrides.pop("strategy", "default"), **overrides)
    if arch == "qwen2_vl":
        vision.update(embed_dim=16, mlp_ratio=2)
        config_class = transformers.Qwen2VLConfig
    else:
        vision.update(intermediate_size=48, out_hidden_size=32, window_size=16,
                      fullatt_block_indexes=[1])
        config_class = transformers.Qwen2_5_VLConfig
    ids = dict(image_token_id=token_ids["<|image_pad|>"],
               video_token_id=token_ids["<|video_pad|>"],
               vision_start_token_id=token_ids["<|vision_start|>"],
               vision_end_token_id=token_ids["<|vision_end|>"])
    return config_class(text_config={**text, **overrides}, vision_config=vision, **ids)


def save_tiny_vision_model(directory: Path, arch: str = "qwen2_vl", seed: int = 0,
                           **overrides) -> Path:
    """A random vision-language model of tiny sizes as save_pretrained writes it, with its
    tokenizer (the vision tokens special, a chat template taking images) and its image
    processor: Qwen's with 4-pixel patches, images resized to 8..32 pixels a side; LLaVA's
    (``tower``: a CLIP or SigLIP vision config) to 16 x 16."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    directory = Path(directory)
    image_text = IMAGE_TEXT["llava" if arch == "llava" else "qwen"]
    save_tiny_tokenizer(directory, chat_template=vision_chatml(image_text),
                        extra_special=VISION_TOKENS)
    tokens = transformers.AutoTokenizer.from_pretrained(str(directory))
    token_ids = {token: tokens.convert_tokens_to_ids(token) for token in VISION_TOKENS}
    torch.manual_seed(seed)
    config = tiny_vision_config(arch, token_ids, **overrides)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(str(directory))
    _tiny_image_processor(arch, config).save_pretrained(str(directory))
    return directory


def _tiny_image_processor(arch: str, config):
    if arch == "llava":
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
        from transformers.models.siglip.image_processing_pil_siglip import (
            SiglipImageProcessorPil)

        if config.vision_config.model_type == "siglip_vision_model":
            return SiglipImageProcessorPil(size={"height": 16, "width": 16})
        return CLIPImageProcessorPil(size={"shortest_edge": 16},
                                     crop_size={"height": 16, "width": 16})
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil)

    return Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2,
                                    min_pixels=8 * 8, max_pixels=32 * 32)
