"""``amp-trainer doctor``: the four-step FP16 triage (:func:`amp_trainer.doctor.diagnose`) on a
saved model and a batch made from texts, a file or saved tensors; or on a recipe config's model
and first batch. Only ``--config`` and the recipes' model names load recipe code, inside
:func:`run`."""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Sequence
from typing import Any

from amp_trainer.cli.common import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_LR,
    RECIPE_MODEL_NAMES,
    SAMPLE_INPUTS_HELP,
    check_model_arg,
    check_sample_inputs,
    load_sample_inputs,
    load_texts,
    number,
    positive_int,
    sample_inputs_usage,
    write_json_output,
)
from amp_trainer.entry_point import EXIT_FAILED, EXIT_OK, UsageError

__all__ = ["add_parser", "run"]


def add_parser(commands: Any) -> None:
    """Add ``doctor`` to the ``amp-trainer`` subcommands (``commands``: argparse's subparsers)."""
    doctor = commands.add_parser(
        "doctor",
        help="find out why FP16 training produces inf/NaN (four-step triage)",
        description=(
            "Runs a few steps of pure FP32, FP16 autocast without a scaler, full AMP with "
            "DynamicLossScaler, then lower learning rates, on copies of the model and one batch; "
            "names the first module that overflows and prints a verdict with a suggested fix. "
            "With --config, the model and batch are those of a recipe config (YAML), built by "
            "the same data functions the recipe uses, at the config's learning rate."
        ),
        epilog="examples:\n  amp-trainer doctor --model runs/bert --texts 'great' 'awful' "
        "--lr 1e-3\n  amp-trainer doctor --config configs/gpt2_offline.yaml --steps 2\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    target = doctor.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--model",
        help="model folder or hub id; or a recipe's model name "
        f"({', '.join(RECIPE_MODEL_NAMES)}): built as its recipe builds it, on the recipe's "
        "built-in defaults (its flags' defaults, as with --config none)",
    )
    target.add_argument(
        "--config",
        metavar="YAML",
        help="a recipe config (configs/*.yaml): its model, first training batch and lr",
    )
    source = doctor.add_mutually_exclusive_group()
    source.add_argument("--texts", nargs="+", metavar="TEXT", help="the batch's texts")
    source.add_argument(
        "--data",
        metavar="FILE",
        help="one text per line (.txt) or JSON lines with 'text' and optional 'label' (.jsonl)",
    )
    source.add_argument(
        "--sample-inputs",
        metavar="FILE",
        help=SAMPLE_INPUTS_HELP + " (the batch; labels made as without it unless it has them)",
    )
    doctor.add_argument(
        "--lr",
        type=number(0.0, float("inf"), low_open=True),
        help=f"learning rate of the failing run (default: the config's, else {DEFAULT_LR:g})",
    )
    doctor.add_argument("--steps", type=positive_int, default=4, help="steps per stage")
    doctor.add_argument(
        "--loss-scale",
        type=number(0.0, float("inf"), low_open=True),
        default=2.0**16,
        help="the loss scale the run trains at (its logged loss_scale): the AMP stage starts "
        "there and the gradient-underflow check measures there",
    )
    doctor.add_argument(
        "--batch-size",
        type=positive_int,
        help=f"examples in the batch (default: the config's per_device_train_batch_size, "
        f"else {DEFAULT_BATCH_SIZE})",
    )
    doctor.add_argument("--device", help="default: cuda if available, else cpu")
    doctor.add_argument("--json", metavar="PATH", help="also write the diagnosis as JSON")
    doctor.set_defaults(handler=run)


_CLASSIFIER_SUFFIXES = (
    "ForSequenceClassification",
    "ForImageClassification",
    "ForAudioClassification",
)
_CTC_TARGET_LENGTH = 4  # CTC targets must fit the shortest output: 16 frames here


def _doctor_batch(
    model: Any,
    args: argparse.Namespace,
    path: str,
    texts: Sequence[str] | None,
    labels: Any,
    sample_inputs: dict | None,
) -> dict:
    """The model's inputs, made as :mod:`amp_trainer.export.sample_inputs` makes export's
    (token ids, pixels, speech features, raw audio; decoder inputs for an encoder-decoder) or
    read from ``--sample-inputs``, plus labels so the model returns a loss
    (:func:`_add_labels`)."""
    from amp_trainer.export.loading import load_processor, load_tokenizer
    from amp_trainer.export.sample_inputs import (
        SampleInputsError,
        main_input_name,
        make_sample_batch,
    )

    if sample_inputs is not None:
        import torch

        from amp_trainer.export.sample_inputs import as_model_dtype

        checked = check_sample_inputs(model, sample_inputs, args.sample_inputs)
        # FP16 features saved from an FP16 pipeline: the FP32 stages need FP32, as in export.
        batch = as_model_dtype(checked, torch.float32)
        return _add_labels(model, batch, None, f"--sample-inputs {args.sample_inputs}")
    where = f"--model {args.model}"
    main = main_input_name(model)
    tokenizer = processor = None
    if main == "input_ids":
        tokenizer = load_tokenizer(path)
        if texts and tokenizer is None:
            raise UsageError(f"{where}: no tokenizer saved there to encode the texts")
    else:
        processor = load_processor(path)
    try:
        batch = make_sample_batch(model, tokenizer, texts, processor=processor)
    except SampleInputsError as err:
        raise sample_inputs_usage(err, where) from None
    batch_size = args.batch_size or DEFAULT_BATCH_SIZE
    batch = {name: tensor[:batch_size] for name, tensor in batch.items()}
    return _add_labels(model, batch, labels, where)


def _add_labels(model: Any, batch: dict, labels: Any, where: str) -> dict:
    """``batch`` plus ``labels`` (unless it has them) so the model returns a loss: class ids
    for a classifier (given, or cycling through the classes), float targets for a regressor,
    short random targets for CTC, the decoder's next tokens for an encoder-decoder, the inputs
    themselves (padding ignored) for language models.

    Why the doctor needs them: it diagnoses training steps, and transformers models compute
    their loss from ``labels``; a model that takes none (no task head) is refused here.
    """
    import torch

    if "labels" in batch:
        return batch
    name = type(model).__name__
    if "labels" not in inspect.signature(model.forward).parameters:
        raise UsageError(
            f"{where}: {name} takes no labels, so it has no loss to diagnose; save the model "
            "with its task head (e.g. ...ForSequenceClassification, ...ForCausalLM)"
        )
    rows = next(iter(batch.values())).shape[0]
    config = model.config
    if name.endswith(_CLASSIFIER_SUFFIXES):
        if config.num_labels == 1:
            batch["labels"] = torch.tensor(
                [float(v) for v in labels] if labels else [0.0] * rows, dtype=torch.float32
            )
            return batch
        values = (
            [int(v) for v in labels] if labels else [i % config.num_labels for i in range(rows)]
        )
        bad = [v for v in values if not 0 <= v < config.num_labels]
        if bad:
            raise UsageError(
                f"label {bad[0]} is outside [0, {config.num_labels - 1}] for this model"
            )
        batch["labels"] = torch.tensor(values, dtype=torch.long)
    elif name.endswith("ForCTC"):
        # Targets skip the blank (the pad id) and fit in the shortest output sequence.
        blank = getattr(config, "pad_token_id", None) or 0
        ids = torch.randint(0, config.vocab_size - 1, (rows, _CTC_TARGET_LENGTH))
        batch["labels"] = ids + (ids >= blank).long()
    elif "decoder_input_ids" in batch:
        decoder = batch["decoder_input_ids"]
        source = batch.get("input_ids")
        if source is not None and source.shape == decoder.shape:
            # Text: the decoder was fed the inputs shifted right, so its targets are the inputs.
            batch["labels"] = source.masked_fill(batch["attention_mask"] == 0, -100)
        else:  # the next decoder token; nothing follows the last one
            targets = torch.full_like(decoder, -100)
            targets[:, :-1] = decoder[:, 1:]
            batch["labels"] = targets
    elif "input_ids" in batch:
        mask = batch.get("attention_mask")
        ids = batch["input_ids"]
        batch["labels"] = ids if mask is None else ids.masked_fill(mask == 0, -100)
    else:
        raise UsageError(
            f"{where}: cannot make labels for {name} (no class, CTC, decoder or token-id "
            "head); put a 'labels' tensor in --sample-inputs FILE"
        )
    return batch


def _recipe_batch(args: argparse.Namespace) -> tuple[Any, dict, float]:
    """Model, batch and lr of a recipe config (``--config``; or ``--model tiny-bert``: the
    recipe's built-in defaults), built by
    :func:`amp_trainer.recipes.models.load_recipe_batch`."""
    from amp_trainer.recipes.models import load_recipe_batch

    if args.texts or args.data or args.sample_inputs:
        option = "--texts" if args.texts else "--data" if args.data else "--sample-inputs"
        what = f"--config {args.config}" if args.config else f"--model {args.model}"
        raise UsageError(f"{option} cannot be combined with {what}: the recipe's data is used")
    if not args.verbose:
        import datasets

        datasets.disable_progress_bars()  # one bar per tokenization pass otherwise
    if args.config:
        import yaml

        try:
            recipe = load_recipe_batch(args.config, args.batch_size)
        except yaml.YAMLError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else "syntax error"
            raise UsageError(f"--config {args.config}: not valid YAML ({first})") from None
        where = f"config {args.config}"
    else:
        recipe = load_recipe_batch({"model_name_or_path": args.model}, args.batch_size)
        where = f"{args.model} with the recipe's defaults"
    lr = args.lr if args.lr is not None else recipe.learning_rate
    shape = "x".join(str(n) for n in recipe.batch["input_ids"].shape)
    print(
        f"recipe {where}: {recipe.task}, {type(recipe.model).__name__}, "
        f"batch {shape} (input_ids), lr {lr:g}"
    )
    return recipe.model, recipe.batch, lr


def run(args: argparse.Namespace) -> int:
    """Diagnose ``args``' model and batch (``amp-trainer doctor``); the exit code: 0 healthy,
    1 not."""
    from amp_trainer.doctor import Verdict, diagnose

    if args.config or args.model in RECIPE_MODEL_NAMES:
        model, batch, lr = _recipe_batch(args)
    else:
        from amp_trainer.export import load_model

        path = check_model_arg(args.model)
        batch_size = args.batch_size or DEFAULT_BATCH_SIZE
        texts, labels = (args.texts, None)
        if args.data:
            texts, labels = load_texts(args.data, batch_size)
        elif texts:
            texts = texts[:batch_size]
        # A bad file is refused before the model loads; its names are checked after.
        inputs = load_sample_inputs(args.sample_inputs) if args.sample_inputs else None
        model = load_model(path)
        batch = _doctor_batch(model, args, path, texts, labels, inputs)
        lr = args.lr if args.lr is not None else DEFAULT_LR
    diagnosis = diagnose(
        model, batch, lr=lr, steps=args.steps, device=args.device, loss_scale=args.loss_scale
    )
    print(diagnosis)
    if args.json:
        write_json_output(args.json, diagnosis.to_dict())
    return EXIT_OK if diagnosis.verdict is Verdict.HEALTHY else EXIT_FAILED
