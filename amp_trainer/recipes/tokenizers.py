"""Tokenizers trained locally for the recipes' from-scratch models, cached on disk.

A from-scratch recipe model (``tiny-bert``, ``tiny-gpt2``) gets a tokenizer trained on the train
split only: WordPiece for BERT, byte-level BPE for GPT-2. Training takes seconds, so the result is
cached under :func:`cache_dir`, keyed by a hash of the corpus and the settings, and a second run
(or ``amp-trainer doctor --config`` on the same config) loads the identical tokenizer. An
unreadable entry (a torn or garbled file) is trained again; a read-only cache falls back to a
folder under the system temp dir, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amp_trainer.atomic_files import write_text_atomic

if TYPE_CHECKING:  # pragma: no cover - imported lazily: `transformers` is heavy
    from transformers import PreTrainedTokenizerFast

__all__ = ["train_byte_level_bpe_tokenizer", "train_wordpiece_tokenizer"]

logger = logging.getLogger(__name__)


def _show_progress() -> bool:
    """Whether the tokenizers trainer draws its bars: on a terminal, unless progress bars are
    off (a recipe's ``--disable_tqdm true``). Into a file or pipe it writes no bar, only three
    empty lines on stdout, in the middle of the run's output."""
    from amp_trainer.recipes.output import progress_bars_enabled

    return sys.stdout.isatty() and progress_bars_enabled()


def cache_dir() -> Path:
    """Where trained tokenizers are cached: ``$AMP_TRAINER_CACHE``, else ``~/.cache/amp-trainer``.

    ``$XDG_CACHE_HOME`` is honoured as the parent of ``amp-trainer`` when set, as pip and the
    Hugging Face libraries do.
    """
    explicit = os.environ.get("AMP_TRAINER_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "amp-trainer"


def _cached_tokenizer(
    kind: str,
    texts: Sequence[str],
    settings: dict[str, Any],
    build: Callable[[Sequence[str]], Any],
) -> Any:
    """Load ``kind`` from the cache or train it with ``build(texts)`` and cache it atomically.

    The key covers the corpus, the settings and the ``tokenizers`` version (its serialisation
    format has changed between releases), so a stale entry is never picked up.
    """
    import tokenizers

    digest = hashlib.sha256()
    header = {"kind": kind, "settings": settings, "tokenizers": tokenizers.__version__}
    digest.update(json.dumps(header, sort_keys=True).encode("utf-8"))
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    name = f"{kind}-{digest.hexdigest()[:20]}.json"
    path = cache_dir() / "tokenizers" / name
    # Where the entry goes when the cache is read-only (a shared or container-baked cache).
    fallback = Path(tempfile.gettempdir()) / "amp-trainer-cache" / "tokenizers" / name
    for cached in (path, fallback):
        if not cached.is_file():
            continue
        logger.info("Loading cached %s tokenizer from %s", kind, cached)
        try:
            return tokenizers.Tokenizer.from_file(str(cached))
        except Exception as err:  # tokenizers raises a bare Exception for a torn/garbled file
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            logger.warning(
                "Cached tokenizer %s is unreadable (%s); training it again.", cached, reason
            )
    logger.info("Training a %s tokenizer on %d texts (cached at %s)", kind, len(texts), path)
    tokenizer = build(texts)
    try:
        write_text_atomic(path, tokenizer.to_str())
    except OSError as err:
        # A read-only (or full) cache must not cost the run: cache in a temp folder instead.
        logger.warning(
            "Cannot write the tokenizer cache %s (%s); caching in %s instead. Set "
            "AMP_TRAINER_CACHE to a writable folder.",
            path,
            err.strerror or err,
            fallback,
        )
        try:
            write_text_atomic(fallback, tokenizer.to_str())
        except OSError:
            logger.warning("Cannot write %s either; the tokenizer is not cached.", fallback)
    return tokenizer


def train_wordpiece_tokenizer(
    texts: Sequence[str], vocab_size: int = 4000, model_max_length: int = 128
) -> PreTrainedTokenizerFast:
    """A lower-casing BERT-style WordPiece tokenizer trained on ``texts`` (train split only).

    Special tokens and post-processing (``[CLS] a [SEP] b [SEP]`` with token type ids) match
    ``bert-base-uncased``, so a model built from a ``BertConfig`` uses it like the real one.
    """
    if vocab_size < 100:
        raise ValueError(f"vocab_size must be >= 100 for a WordPiece tokenizer, got {vocab_size}")
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

    def build(corpus: Sequence[str]) -> Any:
        from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
        from tokenizers.trainers import WordPieceTrainer

        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = WordPieceTrainer(
            vocab_size=vocab_size, special_tokens=specials, show_progress=_show_progress()
        )
        tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
        )
        return tok

    settings = {"vocab_size": vocab_size, "specials": specials}
    tok = _cached_tokenizer("wordpiece", list(texts), settings, build)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=model_max_length,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def train_byte_level_bpe_tokenizer(
    texts: Sequence[str], vocab_size: int = 4000, model_max_length: int = 1024
) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE tokenizer trained on ``texts`` (train split only).

    ``<|endoftext|>`` is the BOS, EOS and padding token, as in GPT-2; byte-level BPE has no
    unknown tokens, so any text round-trips.
    """
    if vocab_size < 257:
        raise ValueError(
            f"vocab_size must be >= 257 for byte-level BPE (256 bytes + 1), got {vocab_size}"
        )
    eos = "<|endoftext|>"

    def build(corpus: Sequence[str]) -> Any:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
        from tokenizers.trainers import BpeTrainer

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[eos],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=_show_progress(),
        )
        tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
        return tok

    settings = {"vocab_size": vocab_size, "eos": eos}
    tok = _cached_tokenizer("byte-level-bpe", list(texts), settings, build)
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=model_max_length,
        bos_token=eos,
        eos_token=eos,
        unk_token=eos,
        pad_token=eos,
    )
