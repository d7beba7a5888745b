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

#: "Tiny", in the field names most transformers configs share (BERT, Llama, Phi3, ViT, wav2vec2).
TINY_SIZES: dict[str, int] = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
)
#: The same sizes in the encoder-decoder field names (BART, Whisper).
TINY_SEQ2SEQ_SIZES: dict[str, int] = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
)
#: A tiny causal decoder with grouped-query attention (Llama, Phi3).
_TINY_GQA_DECODER: dict[str, int] = dict(
    vocab_size=128, **TINY_SIZES, num_key_value_heads=2, max_position_embeddings=64
)


def _seeded(model_class: type, config_class: type, seed: int, **fields: Any) -> Any:
    """``model_class(config_class(**fields))`` with torch seeded first, so that the same call
    gives the same weights."""
    torch.manual_seed(seed)
    return model_class(config_class(**fields))


# ---- token-id models -------------------------------------------------------------------------
def make_tiny_bert(num_labels: int = 2, vocab_size: int = 128, seed: int = 0, **overrides):
    """A 2-layer, 32-wide BERT classifier: small enough for CPU fp16, real enough to overflow.
    ``overrides`` go to the config and may change the sizes too."""
    from transformers import BertConfig, BertForSequenceClassification

    fields = {**TINY_SIZES, "max_position_embeddings": 64, **overrides}
    return _seeded(
        BertForSequenceClassification,
        BertConfig,
        seed,
        vocab_size=vocab_size,
        num_labels=num_labels,
        **fields,
    )


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

    return _seeded(
        GPT2LMHeadModel,
        GPT2Config,
        seed,
        vocab_size=vocab_size,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
        **overrides,
    )


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

    config = dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    config.update(pad_token_id=0, decoder_start_token_id=0)  # as t5-small's config.json has it
    config.update(overrides)
    return _seeded(T5ForConditionalGeneration, T5Config, seed, **config)


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

    return _seeded(
        BartForConditionalGeneration,
        BartConfig,
        seed,
        vocab_size=128,
        **TINY_SEQ2SEQ_SIZES,
        max_position_embeddings=64,
    )


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _seeded(
        LlamaForCausalLM, LlamaConfig, seed, **_TINY_GQA_DECODER, bos_token_id=1, eos_token_id=2
    )


def tiny_phi3(seed: int = 0):
    """A 2-layer, 32-wide Phi3 causal LM: pre-norm blocks, untied FP16 head."""
    from transformers import Phi3Config, Phi3ForCausalLM

    return _seeded(
        Phi3ForCausalLM,
        Phi3Config,
        seed,
        **_TINY_GQA_DECODER,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


# ---- models that take no token ids -----------------------------------------------------------
def tiny_whisper(seed: int = 0):
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    return _seeded(
        WhisperForConditionalGeneration,
        WhisperConfig,
        seed,
        vocab_size=128,
        **TINY_SEQ2SEQ_SIZES,
        num_mel_bins=16,
        max_source_positions=32,  # 64 feature frames: two stride-1/stride-2 convolutions
        max_target_positions=32,
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_vit(seed: int = 0):
    from transformers import ViTConfig, ViTForImageClassification

    return _seeded(
        ViTForImageClassification,
        ViTConfig,
        seed,
        **TINY_SIZES,
        image_size=32,
        patch_size=8,
        num_labels=3,
    )


def tiny_wav2vec2_ctc(seed: int = 0, **overrides):
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    return _seeded(
        Wav2Vec2ForCTC,
        Wav2Vec2Config,
        seed,
        vocab_size=32,
        **TINY_SIZES,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        **overrides,
    )


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


class TwoBranchNet(torch.nn.Module):
    """Two parallel MLP heads on the same features, the ``weak`` one's loss multiplied by
    ``weak_factor``. The ``strong`` head's loss is summed over the batch on features 10x larger,
    so its gradients set the highest loss scale that does not overflow; at ``weak_factor=1e-9``
    the weak head's whole gradient sits below FP16's smallest subnormal even there (an FP32
    backward finds it nonzero: half the model's gradient)."""

    def __init__(self, weak_factor: float = 1e-9, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)

        def head() -> torch.nn.Module:
            return torch.nn.Sequential(
                torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
            )

        self.strong, self.weak = head(), head()
        self.weak_factor = weak_factor

    def forward(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = torch.nn.functional.cross_entropy
        strong = loss(self.strong(features * 10.0).float(), labels, reduction="sum")
        weak = loss(self.weak(features).float(), labels)
        return {"loss": strong + self.weak_factor * weak}


def two_branch_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "features": torch.randn(64, 32, generator=g),
        "labels": torch.randint(0, 4, (64,), generator=g),
    }
