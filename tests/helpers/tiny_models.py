"""Tiny real models built from configs (hidden 32, 2 layers: nothing is downloaded), their
batches, the tokenizers the tests train here and the checkpoints the recipe tests load.

Small enough for CPU fp16 in seconds, real enough to overflow. Each builder seeds torch first, so
the same call gives the same weights. transformers is imported inside each builder: the suite's
offline switches (``tests/conftest.py``) are set before transformers first reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


# ---- token-id models -------------------------------------------------------------------------
def make_tiny_bert(num_labels: int = 2, vocab_size: int = 128, seed: int = 0, **overrides):
    """A 2-layer, 32-wide BERT classifier: small enough for CPU fp16, real enough to overflow."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=num_labels,
        **overrides,
    )
    return BertForSequenceClassification(config)


def bert_batch(labels=(0, 1, 0, 1), seed=0) -> dict[str, torch.Tensor]:
    """A classification batch for :func:`make_tiny_bert`: 12 random ids a row (ids 5-127)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 128, (len(labels), 12), generator=generator)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": torch.tensor(labels),
    }


def make_tiny_gpt2(vocab_size: int = 128, seed: int = 0, **overrides):
    """A 2-layer, 32-wide GPT-2 LM head model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
        **overrides,
    )
    return GPT2LMHeadModel(config)


def tiny_gpt2_for(tokenizer, seed: int = 0):
    """:func:`make_tiny_gpt2` over ``tokenizer``'s vocabulary, its bos/eos/pad ids the tokenizer's
    eos (as GPT-2's own tokenizer has it), in the config and the generation config."""
    model = make_tiny_gpt2(vocab_size=len(tokenizer), seed=seed)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, name, tokenizer.eos_token_id)
        setattr(model.generation_config, name, tokenizer.eos_token_id)
    return model


def tiny_t5(seed: int = 0, **overrides):
    """A 2-layer T5 (encoder and decoder), 32 wide, vocabulary 128; ``overrides`` go to the
    config (``vocab_size``, ``dropout_rate``, ``decoder_start_token_id`` ...)."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(seed)
    config = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    config.update(pad_token_id=0, decoder_start_token_id=0)  # as t5-small's config.json has it
    config.update(overrides)
    return T5ForConditionalGeneration(T5Config(**config))


#: The module of :func:`make_overflowing_t5` whose output passes 65504.
WO = "encoder.block.0.layer.1.DenseReluDense.wo"


def make_overflowing_t5(declared: bool = False, seed: int = 0):
    """A 2-layer T5 whose block-0 encoder ``wo`` output is > 65504 on every token (finite FP32).

    ``declared=False`` drops T5's own ``_keep_in_fp32_modules = ["wo"]`` (per instance, as
    transformers 5 keeps it), i.e. a model that does not know which layer overflows.
    """
    model = tiny_t5(seed=seed, dropout_rate=0.0)
    if not declared:
        model._keep_in_fp32_modules = set()
    with torch.no_grad():
        model.get_submodule(WO).weight.mul_(1e5)
    return model


def tiny_bart(seed: int = 0):
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    config = BartConfig(
        vocab_size=128,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
    )
    return BartForConditionalGeneration(config)


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config)


def tiny_phi3(seed: int = 0):
    """A 2-layer, 32-wide Phi3 causal LM: pre-norm blocks, untied FP16 head."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    config = Phi3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return Phi3ForCausalLM(config)


# ---- models that take no token ids -----------------------------------------------------------
def tiny_whisper(seed: int = 0):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(seed)
    config = WhisperConfig(
        vocab_size=128,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=16,
        max_source_positions=32,  # 64 feature frames: two stride-1/stride-2 convolutions
        max_target_positions=32,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return WhisperForConditionalGeneration(config)


def tiny_vit(seed: int = 0):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    config = ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        num_labels=3,
    )
    return ViTForImageClassification(config)


def tiny_wav2vec2_ctc(seed: int = 0, **overrides):
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    torch.manual_seed(seed)
    config = Wav2Vec2Config(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        **overrides,
    )
    return Wav2Vec2ForCTC(config)


# ---- tokenizers trained here, and checkpoints saved with them --------------------------------
COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
THINGS = ["apple", "car", "house", "bird", "river", "stone", "cloud", "book"]


def colour_sentences(n: int) -> list[str]:
    """``n`` short English sentences over 16 words (8 colours, 8 things), in a fixed order."""
    return [
        f"The {COLOURS[i % 8]} {THINGS[(i * 3) % 8]} is next to the {THINGS[(i * 5) % 8]}."
        for i in range(n)
    ]


def colour_bpe_tokenizer():
    """A byte-level BPE tokenizer (GPT-2's kind, 300 ids) trained on 64 colour sentences.

    Trained into ``AMP_TRAINER_CACHE``: a test points that at its temporary folder first."""
    from amp_trainer.recipes.tokenizers import train_byte_level_bpe_tokenizer

    return train_byte_level_bpe_tokenizer(colour_sentences(64), vocab_size=300, model_max_length=64)


def save_tiny_bert_mlm(model_dir: Path, texts: list[str], model_max_length: int) -> Any:
    """Save a tiny BERT masked-LM checkpoint with a WordPiece tokenizer (200 ids) trained on
    ``texts`` into ``model_dir``, as a hub BERT folder looks (the recipes add a classifier head);
    returns the tokenizer."""
    from transformers import BertConfig, BertForMaskedLM

    from amp_trainer.recipes.tokenizers import train_wordpiece_tokenizer

    tokenizer = train_wordpiece_tokenizer(texts, vocab_size=200, model_max_length=model_max_length)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=model_max_length,
    )
    BertForMaskedLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return tokenizer
