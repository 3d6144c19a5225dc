"""Architecture coverage, no GPU needed: tiny configs of popular `transformers` models exported the way users
export them (TorchScript, opset 17, each model's default attention implementation), fp32 and fp16 (onnxruntime's
converter), then `ortfuse optimize` and `ortfuse check --emulate` on each. The table says what ortfuse fuses in
each architecture (regions by kind, nodes before and after, attention fused or not) and whether every kernel
matched ORT in CPU emulation. Random weights, tiny widths: this is about graph patterns, not speed.

    python -m ortfuse.bench.coverage [--models NAME ...] [--dtypes fp32 fp16 bf16] [--opset N] [--out FILE.md]

`--opset 22` converts each export (onnx's version converter) before the dtypes are made: ONNX has bf16 Conv
and pools from opset 22, so that is where a bf16 CNN computes its convolutions in bf16. With `--exporter
dynamo` torch exports at that opset itself (at 23 it writes ONNX's Attention, RMSNormalization and
RotaryEmbedding).

A failed export (a transformers version without the class) is a row with its error, never a crash of the
sweep; a parity failure or an optimizer error is a row marked FAIL and the exit status is 1."""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

S = 16  # tokens
EXPORT_OPSET = 17  # the TorchScript exporter's opset here (the one most exported models in use carry)
_SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100)
_LM = dict(_SMALL, num_key_value_heads=2, max_position_embeddings=64)


def _text(cfg: str, cls: str, **kw: Any) -> Callable[[], tuple[Any, dict]]:
    def make() -> tuple[Any, dict]:
        import torch
        import transformers as tf
        ids = torch.randint(0, 90, (2, S))
        mask = torch.ones(2, S, dtype=torch.int64)
        mask[1, -3:] = 0  # padding
        return getattr(tf, cls)(getattr(tf, cfg)(**kw)), {"input_ids": ids, "attention_mask": mask}
    return make


def _image(cfg: str, cls: str, size: int, **kw: Any) -> Callable[[], tuple[Any, dict]]:
    def make() -> tuple[Any, dict]:
        import torch
        import transformers as tf
        return getattr(tf, cls)(getattr(tf, cfg)(**kw)), {"pixel_values": torch.rand(2, 3, size, size)}
    return make


def _audio(cfg: str, cls: str, name: str, shape: tuple[int, ...], **kw: Any) -> Callable[[], tuple[Any, dict]]:
    def make() -> tuple[Any, dict]:
        import torch
        import transformers as tf
        return getattr(tf, cls)(getattr(tf, cfg)(**kw)), {name: torch.randn(*shape)}
    return make


def _decoder(cfg: str, cls: str, **kw: Any) -> Callable[[], tuple[Any, dict]]:
    """A causal LM exported for generation with a KV cache, as a serving stack runs it: input ids of the new
    tokens, a mask over past + new, each layer's past keys and values in, logits and the present keys and
    values (past and new concatenated) out."""
    def make() -> tuple[Any, dict]:
        import torch
        import transformers as tf

        from ortfuse.bench.zoo import with_cache

        config = getattr(tf, cfg)(**kw)
        layers, heads = config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or \
            config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

        past = 5  # traced with 3 new tokens: a single one would let the tracer fold the sequence dim
        mask = torch.ones(2, past + 3, dtype=torch.int64)
        mask[1, :2] = 0  # left padding, as batched generation pads
        inputs = {"input_ids": torch.randint(0, 90, (2, 3)), "attention_mask": mask}
        for i in range(layers):
            for kv in ("key", "value"):
                inputs[f"past_key_values.{i}.{kv}"] = torch.randn(2, heads, past, head_dim)
        return with_cache(getattr(tf, cls)(config)), inputs
    make.decoder = True  # type: ignore[attr-defined]
    return make


def _torch(name: str) -> Callable[[], tuple[Any, dict]]:
    """An architecture transformers does not ship, in plain PyTorch (`bench.torch_nets`)."""
    def make() -> tuple[Any, dict]:
        from ortfuse.bench import torch_nets
        return torch_nets.make(name)
    return make


def _torch_decoder(name: str) -> Callable[[], tuple[Any, dict]]:
    """A plain-PyTorch decoder with a KV cache (`bench.torch_nets`), exported and checked as `_decoder`'s."""
    make = _torch(name)
    make.decoder = True  # type: ignore[attr-defined]
    return make


def _fixed(make: Callable[[], tuple[Any, dict]], **shapes: tuple) -> Callable[[], tuple[Any, dict]]:
    """`make`, optimized with these input shapes fixed (`--input-shape`, names for the dims left symbolic): a
    model that only runs at one size of a dim its export left symbolic."""
    make.fixed = shapes  # type: ignore[attr-defined]
    return make


def _at(make: Callable[[], tuple[Any, dict]], **shapes: tuple[int, ...]) -> Callable[[], tuple[Any, dict]]:
    """`make`, whose export only runs at these input shapes (traced constants): the check feeds them."""
    make.shapes = shapes  # type: ignore[attr-defined]
    return make


_VIT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
_AUDIO = dict(_VIT, intermediate_size=128, conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
              num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)  # wav2vec2's feature encoder, small
MODELS: dict[str, Callable[[], tuple[Any, dict]]] = {
    "distilbert": _text("DistilBertConfig", "DistilBertModel", dim=64, n_layers=2, n_heads=4, hidden_dim=128,
                        vocab_size=100),
    "roberta": _text("RobertaConfig", "RobertaModel", **_SMALL, max_position_embeddings=64),
    "albert": _text("AlbertConfig", "AlbertModel", **_SMALL, embedding_size=32),
    "electra": _text("ElectraConfig", "ElectraModel", **_SMALL, embedding_size=32),
    "deberta_v2": _text("DebertaV2Config", "DebertaV2Model", **_SMALL),
    "t5_encoder": _text("T5Config", "T5EncoderModel", d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                        vocab_size=100),
    "mistral": _text("MistralConfig", "MistralForCausalLM", **_LM),
    "qwen2": _text("Qwen2Config", "Qwen2ForCausalLM", **_LM),
    "phi3": _text("Phi3Config", "Phi3ForCausalLM", **_LM, pad_token_id=0),
    "gemma": _text("GemmaConfig", "GemmaForCausalLM", **_LM, head_dim=16),
    "gpt_neox": _text("GPTNeoXConfig", "GPTNeoXForCausalLM", **_SMALL, rotary_pct=0.5, max_position_embeddings=64),
    "gptj": _text("GPTJConfig", "GPTJForCausalLM", n_embd=64, n_layer=2, n_head=4, rotary_dim=8, vocab_size=100,
                  n_positions=64),
    "opt": _text("OPTConfig", "OPTForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                 vocab_size=100, word_embed_proj_dim=64, max_position_embeddings=64),
    "bloom": _text("BloomConfig", "BloomForCausalLM", hidden_size=64, n_layer=2, n_head=4, vocab_size=100),
    "falcon": _text("FalconConfig", "FalconForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    vocab_size=100),
    "llama_past": _decoder("LlamaConfig", "LlamaForCausalLM", **_LM),
    "qwen2_past": _decoder("Qwen2Config", "Qwen2ForCausalLM", **_LM),
    "gpt2_past": _decoder("GPT2Config", "GPT2LMHeadModel", n_embd=64, n_layer=2, n_head=4, vocab_size=100,
                          n_positions=64, bos_token_id=0, eos_token_id=0),
    "swin": _image("SwinConfig", "SwinModel", 32, image_size=32, patch_size=2, embed_dim=16, depths=[1, 1],
                   num_heads=[2, 2], window_size=4),
    "deit": _image("DeiTConfig", "DeiTModel", 32, image_size=32, patch_size=8, intermediate_size=128, **_VIT),
    "dinov2": _image("Dinov2Config", "Dinov2Model", 32, image_size=32, patch_size=8, mlp_ratio=2, **_VIT),
    "clip_vision": _image("CLIPVisionConfig", "CLIPVisionModel", 32, image_size=32, patch_size=8,
                          intermediate_size=128, **_VIT),
    "segformer": _image("SegformerConfig", "SegformerForSemanticSegmentation", 64, num_encoder_blocks=2, depths=[1, 1],
                        sr_ratios=[2, 1], hidden_sizes=[16, 32], num_attention_heads=[1, 2], decoder_hidden_size=32,
                        strides=[4, 2], patch_sizes=[7, 3], mlp_ratios=[2, 2]),
    "regnet": _image("RegNetConfig", "RegNetModel", 64, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                     groups_width=8),
    "mobilevit": _image("MobileViTConfig", "MobileViTModel", 64, image_size=64, hidden_sizes=[32, 48, 64],
                        neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64]),
    "poolformer": _image("PoolFormerConfig", "PoolFormerModel", 32, depths=[1, 1], hidden_sizes=[16, 32],
                         num_encoder_blocks=2, patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1]),
    "convnextv2": _image("ConvNextV2Config", "ConvNextV2Model", 32, hidden_sizes=[16, 32], depths=[1, 1],
                         num_stages=2),
    "wav2vec2": _audio("Wav2Vec2Config", "Wav2Vec2Model", "input_values", (2, 800), hidden_size=64,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, conv_dim=(16, 16),
                       conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                       num_conv_pos_embedding_groups=4),
    "whisper_encoder": _audio("WhisperConfig", "WhisperForAudioClassification", "input_features", (2, 16, 64),
                              d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128,
                              num_mel_bins=16, max_source_positions=32, decoder_layers=1, decoder_attention_heads=4),
    # session 29
    "qwen3": _text("Qwen3Config", "Qwen3ForCausalLM", **_LM, head_dim=16),
    "gemma2": _text("Gemma2Config", "Gemma2ForCausalLM", **_LM, head_dim=16, sliding_window=8),
    "mpt": _text("MptConfig", "MptForCausalLM", d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64,
                 vocab_size=100),
    "gpt_bigcode": _text("GPTBigCodeConfig", "GPTBigCodeForCausalLM", n_embd=64, n_layer=2, n_head=4, n_positions=64,
                         vocab_size=100, multi_query=True),
    "phi": _text("PhiConfig", "PhiForCausalLM", **_SMALL, partial_rotary_factor=0.5, max_position_embeddings=64),
    "stablelm": _text("StableLmConfig", "StableLmForCausalLM", **_LM, partial_rotary_factor=0.25),
    "bart": _text("BartConfig", "BartModel", d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=100,
                  max_position_embeddings=64),
    "mpnet": _text("MPNetConfig", "MPNetModel", **_SMALL, max_position_embeddings=64),
    "squeezebert": _text("SqueezeBertConfig", "SqueezeBertModel", **_SMALL, embedding_size=64, q_groups=2, k_groups=2,
                         v_groups=2, post_attention_groups=2, intermediate_groups=2, output_groups=2,
                         max_position_embeddings=64),
    "convbert": _text("ConvBertConfig", "ConvBertModel", **_SMALL, embedding_size=32, head_ratio=2, conv_kernel_size=3,
                      max_position_embeddings=64),
    # its pooling is traced at the export's sequence length: checked there
    "funnel": _at(_text("FunnelConfig", "FunnelModel", block_sizes=[1, 1], d_model=64, n_head=4, d_head=16,
                        d_inner=128, vocab_size=100), input_ids=(2, S), attention_mask=(2, S)),
    "convnext": _image("ConvNextConfig", "ConvNextModel", 32, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2),
    "efficientnet": _image("EfficientNetConfig", "EfficientNetModel", 32, image_size=32, width_coefficient=0.25,
                           depth_coefficient=0.25, hidden_dim=320),
    "mobilenet_v2": _image("MobileNetV2Config", "MobileNetV2Model", 32, image_size=32, depth_multiplier=0.25),
    "bit": _image("BitConfig", "BitModel", 32, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                  layer_type="bottleneck", num_groups=4),
    "levit": _image("LevitConfig", "LevitModel", 64, image_size=64, hidden_sizes=[32, 48, 64],
                    num_attention_heads=[2, 2, 2], depths=[1, 1, 1], key_dim=[8, 8, 8]),
    "beit": _image("BeitConfig", "BeitModel", 32, image_size=32, patch_size=8, intermediate_size=128,
                   use_relative_position_bias=True, **_VIT),
    "yolos": _image("YolosConfig", "YolosModel", 32, image_size=[32, 32], patch_size=8, intermediate_size=128,
                    num_detection_tokens=4, **_VIT),
    "pvt": _image("PvtConfig", "PvtModel", 32, image_size=32, num_encoder_blocks=2, depths=[1, 1],
                  sequence_reduction_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[4, 2], strides=[4, 2],
                  num_attention_heads=[1, 2], mlp_ratios=[2, 2]),
    "focalnet": _image("FocalNetConfig", "FocalNetModel", 32, image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                       focal_levels=[2, 2], focal_windows=[3, 3]),
    "swinv2": _image("Swinv2Config", "Swinv2Model", 32, image_size=32, patch_size=2, embed_dim=16, depths=[1, 1],
                     num_heads=[2, 2], window_size=4),
    "resnet": _image("ResNetConfig", "ResNetModel", 32, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1]),
    "yolo": _torch("yolo"),
    "mobilenet_v3": _torch("mobilenet_v3"),
    "shufflenet_v2": _torch("shufflenet_v2"),
    "densenet": _torch("densenet"),
    "unet": _torch("unet"),
    "nanogpt": _torch("nanogpt"),
    "gpt2_legacy_past": _torch_decoder("gpt2_legacy_past"),
    "mistral_past": _decoder("MistralConfig", "MistralForCausalLM", **_LM),
    "qwen3_past": _decoder("Qwen3Config", "Qwen3ForCausalLM", **_LM, head_dim=16),
    "phi3_past": _decoder("Phi3Config", "Phi3ForCausalLM", **_LM, pad_token_id=0),
    "gpt_neox_past": _decoder("GPTNeoXConfig", "GPTNeoXForCausalLM", **_SMALL, rotary_pct=0.5,
                              max_position_embeddings=64),
    "opt_past": _decoder("OPTConfig", "OPTForCausalLM", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         ffn_dim=128, vocab_size=100, word_embed_proj_dim=64, max_position_embeddings=64),
    "bloom_past": _decoder("BloomConfig", "BloomForCausalLM", hidden_size=64, n_layer=2, n_head=4, vocab_size=100),
    "hubert": _audio("HubertConfig", "HubertModel", "input_values", (2, 800), hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=128, conv_dim=(16, 16), conv_stride=(5, 2),
                     conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4),
    # session 42: ModernBERT (rotary, GeGLU, global and sliding-window local attention in turns), CLIP's text
    # tower (causal and padding masks), OLMo-2 (RMSNorm of Q and K), Granite (its multipliers), Gemma 3 (sliding
    # and global layers), SigLIP's vision tower, and Mamba (its slow path: the selective scan unrolled over the
    # traced length, so it runs only at that length)
    "modernbert": _text("ModernBertConfig", "ModernBertModel", hidden_size=64, num_hidden_layers=3,
                        num_attention_heads=4, intermediate_size=128, vocab_size=100, global_attn_every_n_layers=2,
                        local_attention=8, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                        sep_token_id=2),
    "clip_text": _text("CLIPTextConfig", "CLIPTextModel", **_SMALL, max_position_embeddings=64),
    "olmo2": _text("Olmo2Config", "Olmo2ForCausalLM", **_LM),
    "granite": _text("GraniteConfig", "GraniteForCausalLM", **_LM),
    "gemma3": _text("Gemma3TextConfig", "Gemma3ForCausalLM", **_LM, head_dim=16, sliding_window=8),
    "siglip_vision": _image("SiglipVisionConfig", "SiglipVisionModel", 32, image_size=32, patch_size=8,
                            intermediate_size=128, **_VIT),
    "mamba": _at(_text("MambaConfig", "MambaForCausalLM", hidden_size=64, num_hidden_layers=2, vocab_size=100,
                       state_size=8), input_ids=(2, S), attention_mask=(2, S)),
    # session 46: SAM's image encoder (windowed attention over padded windows, decomposed relative positions),
    # ViT-MAE (masking noise drawn on every call), BEiT-style relative bias in Data2Vec, a DPT depth head, and
    # decoders and encoders of other families (ESM's protein encoder, RoFormer's rotary encoder, XLNet's
    # two-stream relative attention, GLPN's depth head)
    "sam_vision": _image("SamVisionConfig", "SamVisionModel", 64, image_size=64, patch_size=8, hidden_size=64,
                         num_hidden_layers=2, num_attention_heads=4, output_channels=32, window_size=4,
                         global_attn_indexes=[1], mlp_dim=128),
    "vit_mae": _image("ViTMAEConfig", "ViTMAEModel", 32, image_size=32, patch_size=8, intermediate_size=128, **_VIT),
    "data2vec_vision": _image("Data2VecVisionConfig", "Data2VecVisionModel", 32, image_size=32, patch_size=8,
                              intermediate_size=128, use_relative_position_bias=True, **_VIT),
    "dpt": _image("DPTConfig", "DPTForDepthEstimation", 32, image_size=32, patch_size=8, intermediate_size=128,
                  backbone_out_indices=[0, 1], neck_hidden_sizes=[16, 32], fusion_hidden_size=32,
                  reassemble_factors=[4, 2], **_VIT),
    "codegen": _text("CodeGenConfig", "CodeGenForCausalLM", n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                     vocab_size=100, n_positions=64),
    "starcoder2": _text("Starcoder2Config", "Starcoder2ForCausalLM", **_LM),
    "nemotron": _text("NemotronConfig", "NemotronForCausalLM", **_LM),
    "xglm": _text("XGLMConfig", "XGLMForCausalLM", d_model=64, num_layers=2, attention_heads=4, ffn_dim=128,
                  vocab_size=100, max_position_embeddings=64),
    "gpt_neo": _text("GPTNeoConfig", "GPTNeoForCausalLM", hidden_size=64, num_layers=2, num_heads=4,
                     attention_types=[[["global", "local"], 1]], window_size=8, vocab_size=100,
                     max_position_embeddings=64),
    "megatron_bert": _text("MegatronBertConfig", "MegatronBertModel", **_SMALL),
    "ernie": _text("ErnieConfig", "ErnieModel", **_SMALL),
    "esm": _text("EsmConfig", "EsmModel", **_SMALL, pad_token_id=1, max_position_embeddings=64),
    "roformer": _text("RoFormerConfig", "RoFormerModel", **_SMALL, embedding_size=64, max_position_embeddings=64),
    "xlnet": _text("XLNetConfig", "XLNetModel", d_model=64, n_layer=2, n_head=4, d_inner=128, vocab_size=100),
    "biogpt": _text("BioGptConfig", "BioGptForCausalLM", **_SMALL, max_position_embeddings=64),
    "rembert": _text("RemBertConfig", "RemBertModel", **_SMALL, input_embedding_size=32, output_embedding_size=32),
    "luke": _text("LukeConfig", "LukeModel", **_SMALL, entity_vocab_size=10, entity_emb_size=16),
    "deberta": _text("DebertaConfig", "DebertaModel", **_SMALL),
    "layoutlm": _text("LayoutLMConfig", "LayoutLMModel", **_SMALL),
    "ibert": _text("IBertConfig", "IBertModel", **_SMALL, max_position_embeddings=64),
    "wavlm": _audio("WavLMConfig", "WavLMModel", "input_values", (2, 800), **_AUDIO, num_buckets=32,
                    max_bucket_distance=100),
    "data2vec_audio": _audio("Data2VecAudioConfig", "Data2VecAudioModel", "input_values", (2, 800), **_AUDIO),
    "sew": _audio("SEWConfig", "SEWModel", "input_values", (2, 800), **_AUDIO, squeeze_factor=2),
    "unispeech": _audio("UniSpeechConfig", "UniSpeechModel", "input_values", (2, 800), **_AUDIO),
    "torchvision_vit": _torch("torchvision_vit"),  # nn.MultiheadAttention, as torchvision's ViT uses it
    # OpenAI CLIP's own text tower: sequence-first nn.MultiheadAttention, a causal mask of its fixed context,
    # which the sequence must equal (optimized as `--input-shape input_ids:batchx16`)
    "clip_text_openai": _fixed(_at(_torch("clip_text_openai"), input_ids=(2, 16)), input_ids=("batch", 16)),
    "glpn": _image("GLPNConfig", "GLPNForDepthEstimation", 64, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                   hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2],
                   mlp_ratios=[2, 2], decoder_hidden_size=16),
}

# Rows `NAME_ortopt`: model NAME run through onnxruntime.transformers' optimizer (python fusions for a GPU, the
# model type given here) before ortfuse, as users who serve with ORT often have it: its fused ops in the input
# (BiasGelu, FastGelu, QuickGelu, SkipLayerNormalization, SkipSimplifiedLayerNormalization, Attention, ...).
# fp16 as the harness makes it: fused in fp32, then converted. (Mistral has no model type of its own; gpt2's
# fusions take its RMSNorms.)
ORT_OPTIMIZED: dict[str, tuple[str, str, int, int]] = {  # source, model type, num_heads, hidden_size (0: detect)
    "distilbert_ortopt": ("distilbert", "bert", 4, 64), "roberta_ortopt": ("roberta", "bert", 4, 64),
    "deit_ortopt": ("deit", "vit", 4, 64), "clip_vision_ortopt": ("clip_vision", "clip", 4, 64),
    "swin_ortopt": ("swin", "swin", 0, 0), "t5_encoder_ortopt": ("t5_encoder", "t5", 4, 64),
    "bart_ortopt": ("bart", "bart", 4, 64), "mistral_ortopt": ("mistral", "gpt2", 4, 64),
    "gpt2_past_ortopt": ("gpt2_past", "gpt2", 4, 64),
}
# Rows of models quantized by onnxruntime.quantization, as users quantize for ORT: `int8`, weights to int8 and
# activations quantized at run time (quantize_dynamic: MatMulInteger, DynamicQuantizeLinear); `qdq`, static int8
# QuantizeLinear/DequantizeLinear pairs around every op, per-channel weights, calibrated on one random batch
# (quantize_static, QDQ format); `int4`, 4-bit block-quantized MatMul weights (MatMulNBitsQuantizer: ORT's
# MatMulNBits), of the fp32 and the fp16 model. ORT's quantized ops stay ORT's; DequantizeLinear fuses, and
# QuantizeLinear where its input is exact (docs/design.md); the rows show what fuses, and that the rest stays
# the same function.
QUANTIZED: dict[str, tuple[str, str]] = {  # source, method
    "roberta_int8": ("roberta", "int8"), "roberta_qdq": ("roberta", "qdq"), "mistral_qdq": ("mistral", "qdq"),
    "mistral_int4": ("mistral", "int4"), "llama_past_int4": ("llama_past", "int4"),
    "resnet_qdq": ("resnet", "qdq"), "mobilenet_v2_qdq": ("mobilenet_v2", "qdq"), "yolo_qdq": ("yolo", "qdq"),
}
NAMES = [*MODELS, *ORT_OPTIMIZED, *QUANTIZED]


def _source(name: str) -> Callable[[], tuple[Any, dict]]:
    """The model maker of `name` (of its source model for an `_ortopt` or quantized row)."""
    return MODELS[ORT_OPTIMIZED[name][0] if name in ORT_OPTIMIZED else QUANTIZED[name][0] if name in QUANTIZED
                  else name]


@dataclass(frozen=True)
class Row:
    model: str
    dtype: str
    kinds: str = ""  # regions by kind
    nodes: str = ""  # before -> after
    attention: str = ""  # attention regions / Softmax nodes
    parity: str = ""  # "ok", "FAIL: ...", or the export / optimize error
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.parity.startswith("FAIL")

    def line(self) -> str:
        parity = re.sub(r"\x1b\[[0-9;]*m", "", self.parity).splitlines()[0] if self.parity else ""  # one line
        return (f"| {self.model} | {self.dtype} | {self.kinds} | {self.nodes} | {self.attention} | {parity} | "
                f"{self.seconds:.1f} |")


def export(name: str, folder: Path, dtypes: Sequence[str] = ("fp32", "fp16"),
           opset: Optional[int] = EXPORT_OPSET, exporter: str = "torchscript") -> dict[str, Path]:
    """ONNX files of the tiny model `name` (the first output only) in `dtypes`: fp32 always (the others are
    converted from it), fp16 and bf16 where asked. TorchScript exports at opset 17, dynamo (torch.export) at
    torch's default opset; converted to `opset` if another (None: keep the exporter's)."""
    import onnx
    import onnx.version_converter
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from ortfuse.bench.bf16 import to_bf16
    from ortfuse.bench.zoo import _opset
    from ortfuse.rewriter._proto import sort_nodes

    if name in ORT_OPTIMIZED:
        return _ort_optimized(name, folder, dtypes, opset, exporter)
    if name in QUANTIZED:
        return _quantized(name, folder, dtypes, opset, exporter)
    import torch

    torch.manual_seed(0)
    module, inputs = MODELS[name]()
    names = list(inputs)

    class First(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module.eval()

        def forward(self, *xs: Any) -> Any:
            out = self.inner(**dict(zip(names, xs)))
            if isinstance(out, dict) and not hasattr(out, "to_tuple"):  # a decoder with a cache: every output
                return tuple(out.values())
            return out if isinstance(out, torch.Tensor) else out[0]

    axes = {n: {0: "batch", **({1: "sequence"} if n in ("input_ids", "attention_mask") else {})} for n in names}
    outputs = ["out"]
    if getattr(_source(name), "decoder", False):  # optimum's naming: the mask spans past and new tokens
        axes["attention_mask"] = {0: "batch", 1: "past_sequence + sequence"}
        axes.update({n: {0: "batch", 2: "past_sequence"} for n in names if n.startswith("past_key_values.")})
        outputs += [n.replace("past_key_values", "present") for n in names if n.startswith("past_key_values.")]
    fp32 = folder / f"{name}-fp32.onnx"
    with torch.no_grad():
        if exporter == "dynamo":  # torch.export's Dims are identifiers: the mask's is renamed after
            from ortfuse.bench.zoo import _export_dynamo
            total = {"past_sequence + sequence": "total_sequence"}
            _export_dynamo(First().eval(), tuple(inputs.values()), names, tuple(outputs),
                           {n: {i: total.get(d, d) for i, d in a.items()} for n, a in axes.items()}, fp32,
                           opset)  # (at 23 torch writes ONNX's Attention and RMSNormalization)
            _rename_dims(fp32, {v: k for k, v in total.items()})
        else:
            torch.onnx.export(First().eval(), tuple(inputs.values()), str(fp32), dynamo=False,
                              opset_version=EXPORT_OPSET, input_names=names, output_names=outputs,
                              dynamic_axes=axes)
    if opset is not None and opset != _opset(fp32):
        onnx.save_model(onnx.version_converter.convert_version(onnx.load(str(fp32)), opset), str(fp32))
    paths = {"fp32": fp32}
    if "fp16" in dtypes:
        half = convert_float_to_float16(onnx.load(str(fp32)), keep_io_types=False)
        _drop_repeated_nodes(half)
        sort_nodes(half.graph)
        paths["fp16"] = folder / f"{name}-fp16.onnx"
        onnx.save_model(half, str(paths["fp16"]))
    if "bf16" in dtypes:
        paths["bf16"] = folder / f"{name}-bf16.onnx"
        onnx.save_model(to_bf16(onnx.load(str(fp32))), str(paths["bf16"]))
    return paths


def _drop_repeated_nodes(m: Any) -> None:
    """Keep one of identical nodes: onnxruntime's float16 converter writes the Cast it puts before a node kept
    in fp32 once per such reader of a tensor, under one name (DPT's torch.export: three `val_302_cast_to_fp32`
    Casts), which neither onnx's checker nor ORT accepts."""
    seen: set[bytes] = set()
    kept = []
    for n in m.graph.node:
        key = n.SerializeToString()
        if key not in seen:
            seen.add(key)
            kept.append(n)
    if len(kept) < len(m.graph.node):
        del m.graph.node[:]
        m.graph.node.extend(kept)


def _rename_dims(path: Path, names: dict[str, str]) -> None:
    """Rename symbolic dims everywhere in the model at `path` (so `check` sees how the mask's length
    relates to the others, as the TorchScript export's names say)."""
    import onnx

    m = onnx.load(str(path))
    g = m.graph
    for vi in [*g.input, *g.output, *g.value_info]:
        for d in vi.type.tensor_type.shape.dim:
            if d.dim_param in names:
                d.dim_param = names[d.dim_param]
    onnx.save_model(m, str(path))


def _ort_optimized(name: str, folder: Path, dtypes: Sequence[str], opset: Optional[int],
                   exporter: str) -> dict[str, Path]:
    from onnxruntime.transformers.optimizer import optimize_model

    from ortfuse.rewriter._proto import sort_nodes

    source, model_type, heads, hidden = ORT_OPTIMIZED[name]
    fp32 = folder / f"{source}-fp32.onnx"  # the source's own row exported it into this folder, when it ran
    if not fp32.exists():
        fp32 = export(source, folder, ("fp32",), opset, exporter)["fp32"]
    paths = {}
    for dtype in [d for d in ("fp32", "fp16") if d in dtypes]:
        opt = optimize_model(str(fp32), model_type=model_type, num_heads=heads, hidden_size=hidden, opt_level=0,
                             use_gpu=True)
        if dtype == "fp16":
            opt.convert_float_to_float16(keep_io_types=False)
        sort_nodes(opt.model.graph)
        paths[dtype] = folder / f"{name}-{dtype}.onnx"
        opt.save_model_to_file(str(paths[dtype]))
    return paths


def _quantized(name: str, folder: Path, dtypes: Sequence[str], opset: Optional[int], exporter: str) -> dict[str, Path]:
    """The source model quantized as QUANTIZED says: fp32 for int8 and qdq (ORT's quantizers take fp32), fp32
    and fp16 for int4."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from ortfuse.bench import zoo

    source, method = QUANTIZED[name]
    wanted = [d for d in ("fp32", "fp16") if d in dtypes and (d == "fp32" or method == "int4")]
    made = {d: folder / f"{source}-{d}.onnx" for d in wanted}  # the source's own rows exported them, when they ran
    if not all(p.exists() for p in made.values()):
        made = export(source, folder, wanted, opset, exporter)
    paths = {}
    for dtype in wanted:
        paths[dtype] = folder / f"{name}-{dtype}.onnx"
        if method == "int8":
            quantize_dynamic(str(made[dtype]), str(paths[dtype]), weight_type=QuantType.QInt8)
        elif method == "qdq":
            zoo.quantize_qdq(made[dtype], paths[dtype])
        else:
            q = MatMulNBitsQuantizer(onnx.load(str(made[dtype])), block_size=32, is_symmetric=True)
            q.process()
            q.model.save_model_to_file(str(paths[dtype]), False)
    return paths


def run(name: str, dtype: str, path: Path) -> Row:
    from collections import Counter

    import onnx

    from ortfuse.api import compile_model
    from ortfuse.check import check_models
    from ortfuse.errors import InputError
    from ortfuse.feeds import default_dim

    t0 = time.perf_counter()
    try:
        res = compile_model(str(path), getattr(_source(name), "fixed", None), "sm_90")
    except Exception as e:  # noqa: BLE001 -- a row, not a crash of the sweep
        return Row(name, dtype, parity=f"FAIL: optimize: {type(e).__name__}: {e}"[:200],
                   seconds=time.perf_counter() - t0)
    kinds = Counter(r.kind for r in res.plan.regions)
    softmax = sum(n.op_type == "Softmax" for n in res.graph.nodes)
    # a decoder with a KV cache: a prompt after a past (8 tokens each) and a one-token generation step
    bindings = [{}, {"input_ids": [2, 1]}] if getattr(_source(name), "decoder", False) else \
        [getattr(_source(name), "shapes", {})]
    def checked(bindings: list[dict]) -> str:
        reps = [check_models(str(path), res.model, emulate=True, input_shapes=b) for b in bindings]
        return "ok" if all(r.ok for r in reps) else \
            "FAIL: " + "; ".join(line for r in reps for line in r.lines() if "FAIL" in line)[:200]

    try:
        try:
            parity = checked(bindings)
        except InputError as e:  # ORT cannot run the export itself at batch 2 (torch's opset-23 Llamas: its
            if "could not run" not in str(e):  # RotaryEmbedding refuses the batch-1 caches torch writes)
                raise
            first = next(iter(onnx.load(str(path), load_external_data=False).graph.input))
            dims = [d.dim_value or default_dim(d.dim_param) for d in first.type.tensor_type.shape.dim]
            parity = checked([{**b, first.name: [1, *(b.get(first.name) or dims)[1:]]} for b in bindings])
            parity += " at batch 1 (ORT cannot run the export at batch 2)" if parity == "ok" else ""
    except InputError as e:  # ORT cannot load or run the export itself (at batch 1 either): nothing to compare
        # with (ORT 1.31.1 at opset 23: no RandomUniformLike(22), an Attention mask broadcast over the queries)
        why = str(e).replace(str(path), "the export").replace(" (give the shapes it expects with --input-shape)", "")
        parity = "not checked: " + re.sub(r"\[ONNXRuntimeError\] : \d+ : \w+ : ", "", why)[:187]
    except Exception as e:  # noqa: BLE001 -- ORT could not run a model: a FAIL row, the sweep goes on
        parity = f"FAIL: check: {type(e).__name__}: {e}"[:200]
    return Row(name, dtype, ", ".join(f"{v} {k}" for k, v in sorted(kinds.items())),
               f"{res.nodes_before} -> {res.nodes_after}", f"{kinds.get('attention', 0)} / {softmax}", parity,
               time.perf_counter() - t0)


def _not_built(name: str, dtype: str) -> str:
    if name in QUANTIZED:
        method = QUANTIZED[name][1]
        return f"not built ({method} rows are {'fp32 and fp16' if method == 'int4' else 'fp32'} models)"
    return f"not built ({dtype}: no {dtype} conversion of ORT's fused ops)"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ortfuse.bench.coverage", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=NAMES, choices=NAMES)
    ap.add_argument("--dtypes", nargs="+", default=["fp32", "fp16"], choices=["fp32", "fp16", "bf16"],
                    help="bf16: the fp16 model retyped (bench/bf16.py; not for the _ortopt rows)")
    ap.add_argument("--exporter", choices=["torchscript", "dynamo"], default="torchscript",
                    help="dynamo: torch.onnx.export(dynamo=True), torch's default since 2.9 (needs onnxscript)")
    ap.add_argument("--opset", type=int, default=None,
                    help="convert each export to this opset first (22: bf16 Conv and pools; default: the "
                         "exporter's own, 17 for TorchScript); dynamo exports at it")
    ap.add_argument("--out", type=Path, help="also write the table here (markdown)")
    args = ap.parse_args(argv)
    import transformers

    dynamo = args.exporter == "dynamo"
    if dynamo:
        opset = "; torch.export (dynamo), " + ("torch's default opset" if args.opset is None else f"opset {args.opset}")
    else:
        opset = "" if args.opset in (None, EXPORT_OPSET) else f"; converted to opset {args.opset}"
    lines = [f"transformers {transformers.__version__}{opset}; regions by kind, graph nodes (after the shape folds) -> "
             "after `optimize`, "
             "attention regions / Softmax nodes, `check --emulate` parity", "",
             "| model | dtype | regions | nodes | attention | parity | s |", "|---|---|---|---:|---:|---|---:|"]
    print("\n".join(lines), flush=True)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            try:
                paths = export(name, Path(tmp), args.dtypes, args.opset, args.exporter)
            except Exception as e:  # noqa: BLE001 -- this transformers may lack the class or its export
                rows = [Row(name, "-", parity=f"export failed: {type(e).__name__}: {e}"[:160])]
            else:
                rows = [run(name, dt, paths[dt]) if dt in paths else Row(name, dt, parity=_not_built(name, dt))
                        for dt in args.dtypes]
            for row in rows:
                failed |= row.failed
                lines.append(row.line())
                print(row.line(), flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
