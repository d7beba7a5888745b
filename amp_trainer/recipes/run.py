"""What both recipes share: their common flags, the start of a run and its end.

Why shared rather than self-contained: the two recipes differ in their data, model and metrics,
and in nothing else. The end of a run is a contract that tests, the ``recipes`` benchmark and
users read (``metrics.json`` and its keys, ``training.png``, ``fp16_export/`` with its parity
report, the summary table, the ``phase_seconds`` names); with a copy in each recipe, every change
to that contract had to be made twice, identically. Here it is written once, and each recipe
keeps only what is its own, top to bottom: config, data, model, trainer, train, finish.

A recipe uses it like this (``recipes/finetune_bert.py`` in full)::

    run = RecipeRun.parse("finetune_bert", argv, ModelArguments, DataArguments, DEFAULT_CONFIG)
    ...                                         # the recipe's own cheap checks
    run.start(count_input_tokens="non_padding")  # logging, seed
    with run.phase("data"):
        ...
    train_result, eval_metrics = run.train_evaluate_save(trainer)
    run.finish(trainer, train_result, model, export_samples=..., results=..., summary=...)

The building blocks a recipe calls (data loading, tokenizers, models, the entry point) are
exported by :mod:`amp_trainer.recipes`, so that a recipe imports from ``amp_trainer`` and
``amp_trainer.recipes`` only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import transformers
from transformers import HfArgumentParser

from amp_trainer import AmpTrainingArguments, export_fp16
from amp_trainer.atomic_files import write_json_atomic
from amp_trainer.ddp_teardown import release_ddp_reducers
from amp_trainer.log_filters import dropping_messages
from amp_trainer.recipes.arguments import SharedDataArguments, SharedModelArguments
from amp_trainer.recipes.config import (
    RunArguments,
    check_output_dir,
    check_report_to,
    given_on_command_line,
    parse_args_with_config,
)
from amp_trainer.recipes.held_logs import holding_library_logs, release
from amp_trainer.recipes.late_sigterm import saved_on_sigterm
from amp_trainer.recipes.launcher import LauncherPrecision, one_process_notice
from amp_trainer.recipes.models import (
    TINY_MODEL_CONFIGS,
    check_model_path,
)
from amp_trainer.recipes.output import (
    cpu_fp16_notices,
    no_pin_memory_on_cpu,
    recipe_output,
)
from amp_trainer.recipes.reporting import (
    LossScaleSummary,
    activation_memory,
    describe_activation_memory,
    describe_export_parity,
    describe_optimizer_steps,
    describe_underflow,
    first_batch,
    format_table,
    lora_base_hint,
    optimizer_updates,
    peak_memory,
    plot_training,
    summarize_loss_scale,
)
from amp_trainer.recipes.resume import (
    RunPreempted,
    interrupted,
    preempted,
    resumed_from_line,
    settle_run_folder,
)

if TYPE_CHECKING:
    from transformers.trainer_utils import TrainOutput

    from amp_trainer import AmpTrainer

__all__ = ["RecipeRun", "SharedDataArguments", "SharedModelArguments", "apply_sample_limits"]


#: The recipes' model classes whose every trainable parameter gets a gradient in each training
#: step: the BERT recipe's classifier (tiny-bert, the offline MiniLM, bert-base-uncased) and the
#: GPT-2 recipe's LM (tiny-gpt2, gpt2). See RecipeRun.settle_ddp.
ALL_PARAMETERS_USED = ("BertForSequenceClassification", "GPT2LMHeadModel")
# transformers' warning about input ids that hold the pad id without an attention mask.
_NO_ATTENTION_MASK = "We strongly recommend passing in an `attention_mask`"

# The training arguments recorded in metrics.json next to the results they produced.
_TRAINING_KEYS = (
    "precision",
    "learning_rate",
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "seed",
    "loss_scale_init",
    "loss_scale_growth_interval",
    "loss_scale_hysteresis",
)


def apply_sample_limits(splits: Any, data_args: SharedDataArguments) -> None:
    """Keep the first ``--max_train_samples`` / ``--max_eval_samples`` rows of ``splits``."""
    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples}
    for split, limit in limits.items():
        if limit is not None:
            splits[split] = splits[split].select(range(min(limit, splits[split].num_rows)))


def _describe_islands(scale: LossScaleSummary | None) -> str | None:
    """The summary's cell for forward overflows: ``0``, or ``2: wo, lm_head`` (the islands)."""
    if scale is None:
        return None
    if not scale.forward_overflows:
        return "0"
    islands = ", ".join(scale.fp32_islands) or "no island added"
    return f"{scale.forward_overflows}: {islands}"


def describe_replays(trainer: AmpTrainer) -> str | None:
    """The summary's cell for skip-streak replays: ``0``, or ``1: fp16_backward_range (amp)``."""
    if trainer.loss_scaler is None:
        return None
    verdicts = list(getattr(trainer, "replay_verdicts", []))
    if not verdicts:
        return "0"
    said = [
        v["verdict"] + (f" ({', '.join(v['modules'])})" if v["modules"] else "") for v in verdicts
    ]
    return f"{len(verdicts)}: {'; '.join(said)}"


def _close_progress_bars(trainer: AmpTrainer) -> None:
    """Close the Trainer's tqdm bars now: left open, they redraw themselves at exit, after the
    line that says how to resume."""
    for callback in trainer.callback_handler.callbacks:
        for name in ("training_bar", "prediction_bar"):
            bar = getattr(callback, name, None)
            if bar is not None and hasattr(bar, "close"):
                bar.close()
                setattr(callback, name, None)


# --------------------------------------------------------------------------------------------
# One run: its arguments, its phase clock, its start and its end
# --------------------------------------------------------------------------------------------


@dataclass
class RecipeRun:
    """One recipe run: ``name`` (the recipe, for its logger and summary title), its parsed
    arguments, and the clock behind ``metrics.json``'s ``phase_seconds``."""

    name: str
    model_args: Any
    data_args: Any
    training_args: AmpTrainingArguments
    started: float
    phase_seconds: dict[str, float] = field(default_factory=dict)
    argv: tuple[str, ...] = ()  # the flags as given: the resume command repeats them
    precision_note: str | None = None  # the launcher's precision and the recipe's disagreed
    # Said while parsing, logged by start() once logging is set up (the CPU FP16 notice).
    notices: list[str] = field(default_factory=list)
    # What the library logged while the flags were parsed, before logging was set up: start()
    # logs it (recipes/held_logs.py).
    held_logs: list[logging.LogRecord] = field(default_factory=list, repr=False)
    _phase_start: float = field(init=False)
    # The run's output policy (recipes/output.py): entered by start(), left by finish().
    _output: contextlib.ExitStack = field(init=False, default_factory=contextlib.ExitStack)

    def __post_init__(self) -> None:
        self._phase_start = self.started

    @classmethod
    @holding_library_logs
    def parse(
        cls,
        name: str,
        argv: Sequence[str],
        model_class: type,
        data_class: type,
        default_config: str | os.PathLike[str],
        *,
        task: str | None = None,
    ) -> RecipeRun:
        """Parse the flags (over ``--config FILE``, else ``default_config``) and check the
        output folder and the model path (``task``: the recipe's, :data:`CLASSIFICATION` or
        :data:`CAUSAL_LM`): a bad value costs seconds, not a built model."""
        # Read by the CUDA caching allocator when it starts; it cuts fragmentation with mixed
        # dtypes.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        started = time.perf_counter()
        parser = HfArgumentParser((model_class, data_class, RunArguments, AmpTrainingArguments))
        # --precision beats accelerate launch's mixed_precision, which beats the config file's.
        launcher = LauncherPrecision(parser, argv)
        # The CPU FP16 notice is said by the training arguments' own __init__, before logging
        # is set up: kept here, logged by start() (see cpu_fp16_notices).
        with cpu_fp16_notices() as notices:
            model_args, data_args, run_args, training_args = parse_args_with_config(
                parser, argv, default_config, reconcile=launcher.settle_config
            )
        launcher.check(training_args.precision)
        # --resume_from_checkpoint true|RUN_DIR|CHECKPOINT, and a run folder of its own.
        settle_run_folder(training_args, argv, reuse=run_args.reuse_output_dir)
        if data_args.train_file is not None:  # ignored then: metrics.json records the files
            data_args.dataset_name = None
        check_output_dir(
            training_args.output_dir,
            reuse=run_args.reuse_output_dir,
            resuming=training_args.resume_from_checkpoint is not None,
            resume_from=training_args.resume_from_checkpoint,
            model=model_args.model_name_or_path,
        )
        check_model_path(model_args.model_name_or_path, task)
        check_report_to(training_args.report_to)
        return cls(
            name,
            model_args,
            data_args,
            training_args,
            started,
            argv=tuple(argv),
            precision_note=launcher.note,
            notices=notices,
        )

    def given(self, *names: str) -> set[str]:
        """Which of ``names`` the command line set, as opposed to the config file or the
        defaults (see :func:`~amp_trainer.recipes.config.given_on_command_line`)."""
        return given_on_command_line(self.argv, names)

    def start(self, *, count_input_tokens: str) -> None:
        """Logging, seed and the precision line. ``count_input_tokens``: how the Trainer counts
        tokens for the tokens/s figure unless the user chose (``non_padding`` or ``all``)."""
        args = self.training_args
        if args.include_num_input_tokens_seen == "no":
            args.include_num_input_tokens_seen = count_input_tokens
        logging.basicConfig(
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            datefmt="%H:%M:%S",
            level=logging.INFO if args.should_log else logging.WARNING,
        )
        transformers.utils.logging.set_verbosity(args.get_process_log_level())
        release(self.held_logs)
        transformers.set_seed(args.seed)
        self._output.enter_context(recipe_output(disable_tqdm=bool(args.disable_tqdm)))
        if count_input_tokens == "all":
            # Every token is real: the texts are concatenated and chunked into full blocks, no
            # block is padded. transformers still says "We strongly recommend passing in an
            # `attention_mask`" because the blocks hold the pad id (the eos id between texts).
            self._output.enter_context(
                dropping_messages("transformers.modeling_utils", _NO_ATTENTION_MASK)
            )
        no_pin_memory_on_cpu(args)
        log = logging.getLogger(self.name)
        log.info(
            "precision=%s device=%s world_size=%d", args.precision, args.device, args.world_size
        )
        if self.precision_note:
            log.warning(self.precision_note)
        processes = one_process_notice(args.world_size, f"recipes/{self.name}.py")
        if processes is not None and args.should_log:
            log.warning(processes)
        for notice in self.notices if args.should_log else ():  # the same on every rank
            log.warning(notice)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase for ``phase_seconds``. A phase runs from the end of the one before (the
        first from :meth:`parse`), so the phases add up to the wall time: nothing between two
        blocks goes uncounted. A phase that raises is not recorded."""
        yield
        now = time.perf_counter()
        self.phase_seconds[name] = round(now - self._phase_start, 2)
        self._phase_start = now

    def settle_ddp(self, model: Any) -> None:
        """Tell DDP the model has no unused parameters when it is a class verified to have
        none, unless the user set ``ddp_find_unused_parameters``; call before the Trainer.

        transformers asks DDP to search for unused parameters on every step by default, which
        costs a traversal of the autograd graph per step and makes every rank warn that it
        found none. Each class in :data:`ALL_PARAMETERS_USED` gives every trainable parameter
        a gradient in a training step (``tests/recipes/test_recipe_ddp.py`` checks it for each
        recipe's model, with and without LoRA), so the search is switched off for them.
        """
        args = self.training_args
        if args.ddp_find_unused_parameters is not None:
            return
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if type(base).__name__ in ALL_PARAMETERS_USED:
            args.ddp_find_unused_parameters = False

    def log_model_size(self, model: Any) -> None:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        logging.getLogger(self.name).info("model: %d parameters, %d trainable", total, trainable)

    def train_evaluate_save(self, trainer: AmpTrainer) -> tuple[TrainOutput, dict[str, float]]:
        """Train (from ``--resume_from_checkpoint`` if given), evaluate, and save the final
        model (LoRA: the adapter) and the tokenizer: the phases train, evaluate and save.

        Ctrl-C, or SIGTERM with ``--enable_jit_checkpoint`` (after its checkpoint is saved),
        ends the run here: one line with the command that resumes (exit 130, 143), no
        evaluation, final model or metrics.json, as the run did not finish. With
        ``--enable_jit_checkpoint``, a SIGTERM while evaluating or saving the final model saves
        the trained model as a checkpoint first (see :mod:`amp_trainer.recipes.late_sigterm`)."""
        with self.phase("train"):
            resume = self.training_args.resume_from_checkpoint
            if resume is not None:
                logging.getLogger(self.name).info(resumed_from_line(resume))
            try:
                train_result = trainer.train(resume_from_checkpoint=resume)
            except KeyboardInterrupt:  # Ctrl-C: one line with the command that resumes
                _close_progress_bars(trainer)
                raise interrupted(self.argv, self.training_args.output_dir) from None
            if trainer.jit_checkpoint is not None:  # SIGTERM (--enable_jit_checkpoint): saved
                _close_progress_bars(trainer)
                raise preempted(self.argv, self.training_args.output_dir, trainer.jit_checkpoint)
        args = self.training_args
        late = saved_on_sigterm(
            trainer, self.argv, args.output_dir, enabled=bool(args.enable_jit_checkpoint)
        )
        try:
            with late:
                with self.phase("evaluate"):
                    eval_metrics = trainer.evaluate()
                with self.phase("save"):
                    trainer.save_model()
        except RunPreempted:
            _close_progress_bars(trainer)
            raise
        return train_result, eval_metrics

    def finish(
        self,
        trainer: AmpTrainer,
        train_result: TrainOutput,
        model: Any,
        *,
        export_samples: list[str],
        results: dict[str, Any],
        summary: list[tuple[str, Any]],
        notes: Sequence[str] = (),
    ) -> None:
        """The end of a run, on the main process: ``training.png``, the FP16 export with its
        parity report, ``metrics.json``, and the summary table on stdout.

        ``model`` is the model the recipe built (a LoRA model is merged for the export);
        ``export_samples`` are the texts of the parity check; ``results`` are the recipe's own
        metrics.json entries (after ``train``); ``summary`` its first table rows, ``notes`` lines
        printed before the table. Other processes only leave the process group.
        """
        if not trainer.is_world_process_zero():
            # Leave the process group before exiting: a rank that just returned while gloo's
            # threads were alive was seen to abort ("terminate called without an active
            # exception"); the DDP Reducer goes first (see amp_trainer.ddp_teardown).
            release_ddp_reducers(trainer.model_wrapped)
            trainer.accelerator.end_training()
            self._output.close()
            # This rank's work is done and nothing of it is left to write: leave without the
            # interpreter's teardown, where a gloo rank can still abort ("terminate called
            # without an active exception") after end_training() and fail the whole launch.
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        model_args, args = self.model_args, self.training_args
        output_dir = Path(args.output_dir)
        scaler = trainer.loss_scaler
        scale = summarize_loss_scale(
            trainer.scale_history, scaler.get_scale() if scaler is not None else None
        )
        runtime = train_result.metrics.get("train_runtime") or float("nan")
        tokens_per_s = trainer.state.num_input_tokens_seen / runtime if runtime else None
        memory: dict[str, Any] = dict(peak_memory(args.device))
        with self.phase("activation memory"):
            activations = activation_memory(
                trainer.accelerator.unwrap_model(trainer.model),
                first_batch(trainer),
                args.device.type,
            )
        memory["activations_saved_for_backward"] = activations
        with self.phase("plot"):
            plot = plot_training(
                trainer.state.log_history,
                trainer.scale_history,
                output_dir / "training.png",
                title=f"{model_args.model_name_or_path} ({args.precision})",
                precision=args.precision,
            )
        with self.phase("fp16_export"):
            export_model = model.merge_and_unload() if model_args.lora else trainer.model
            report = export_fp16(
                export_model,
                output_dir / "fp16_export",
                tokenizer=trainer.processing_class,
                sample_texts=export_samples,
                overwrite=True,
            )
            write_json_atomic(output_dir / "fp16_export_report.json", report.to_dict())
        wall = time.perf_counter() - self.started
        # Where the run's time went (imports and the launcher come before the clock started).
        phases = dict(self.phase_seconds)
        phases["evaluations in train and after"] = round(
            sum(e.get("eval_runtime", 0) for e in trainer.state.log_history), 2
        )
        metrics = {
            "train": train_result.metrics,
            **results,
            # A skipped update is not a step: global_step counts applied ones.
            "optimizer_updates": optimizer_updates(trainer.state),
            "loss_scale": None if scale is None else scale.__dict__,
            # Every underflow check of the run, as logged (grad_underflow, grad_headroom).
            "underflow_checks": [
                {k: e[k] for k in ("step", "grad_underflow", "grad_headroom") if k in e}
                for e in trainer.state.log_history
                if "grad_underflow" in e or "grad_headroom" in e
            ],
            # Each skip streak's replay and its verdict (amp_trainer.skip_streak_replay).
            "replay_verdicts": list(getattr(trainer, "replay_verdicts", [])),
            "tokens_per_second": tokens_per_s,
            "memory": memory,
            "fp16_export_passed": report.passed,
            "fp16_export_thin_evidence": list(report.thin_evidence),
            "fp16_export_sample_texts": list(export_samples),
            "wall_time_s": wall,
            "phase_seconds": phases,
            "precision": args.precision,
            "config": {
                "model": asdict(model_args),
                "data": asdict(self.data_args),
                "training": {k: getattr(args, k) for k in _TRAINING_KEYS},
            },
        }
        write_json_atomic(output_dir / "metrics.json", metrics)

        rows = [
            *summary,
            ("precision", args.precision),
            ("optimizer steps", describe_optimizer_steps(trainer.state)),
            # Exact (not 4 digits): the value a resume starts from, as in scaler.pt.
            (
                "loss scale final (after the last update)",
                None if scale is None else f"{scale.final:.10g}",
            ),
            ("loss scale min", None if scale is None else f"{scale.minimum:.10g}"),
            ("skipped steps", None if scale is None else scale.skipped),
            ("of them forward overflows -> FP32 islands", _describe_islands(scale)),
            ("skip-streak replays (verdicts)", describe_replays(trainer)),
            (
                "gradient underflow (last check)",
                describe_underflow(trainer.state.log_history),
            ),
            ("tokens/s (train)", tokens_per_s),
            ("train time s", runtime),
            ("wall time s", wall),
            ("peak RSS MiB", memory["peak_rss_mib"]),
            ("peak CUDA allocated MiB", memory.get("cuda_max_allocated_mib")),
            (
                "activation memory fp16 / fp32 (saved for backward)",
                describe_activation_memory(activations),
            ),
            ("fp16 export parity", describe_export_parity(report)),
            ("output", str(output_dir)),
            ("plot", str(plot) if plot else "none: matplotlib is not installed"),
        ]
        lora_hint = lora_base_hint(
            model_args.lora,
            model_args.model_name_or_path in TINY_MODEL_CONFIGS,
            model_args.model_name_or_path,
        )
        for line in [*notes, *([lora_hint] if lora_hint else [])]:
            print(line)
        print(format_table(rows, title=f"{self.name}: {model_args.model_name_or_path}"))
        release_ddp_reducers(trainer.model_wrapped)
        trainer.accelerator.end_training()
        self._output.close()
