"""A complete custom Accelerate training loop in FP16 with amp-trainer's loss scaler.

Runs anywhere: on a GPU it is ordinary fp16 mixed precision; on a CPU it is *real* fp16 autocast
plus loss scaling (plain Accelerate silently trains in fp32 there), just slower. Tiny GPT-2 built
from a config, random token data, nothing downloaded.

    python examples/accelerate_loop.py --steps 50
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml \
        examples/accelerate_loop.py --steps 50 --cpu      # two CPU processes on gloo
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

from amp_trainer import AmpAccelerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument(
        "--inject-overflow-at",
        type=int,
        default=3,
        help="write an inf into one gradient at this step (-1: never)",
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run on the CPU even under a GPU-style launcher (the 2-process CPU config)",
    )
    args = parser.parse_args()

    # fp16 everywhere; our DynamicLossScaler replaces torch's GradScaler (knobs as keyword args).
    accelerator = AmpAccelerator(
        mixed_precision="fp16",
        cpu=args.cpu,
        gradient_accumulation_steps=args.grad_accum,
        loss_scaler={"init_scale": 2.0**16, "growth_interval": 20, "hysteresis": 1},
    )
    torch.manual_seed(0)

    # Data: 16 random token sequences, repeated, so the loss visibly falls as they are learned
    # (a real run would tokenize a corpus here).
    vocab, seq_len = 256, 32
    n_samples = args.steps * args.grad_accum * args.batch_size * accelerator.num_processes
    tokens = torch.randint(0, vocab, (16, seq_len)).repeat(n_samples // 16 + 1, 1)[:n_samples]
    loader = DataLoader(TensorDataset(tokens), batch_size=args.batch_size, shuffle=True)

    # Model: tiny GPT-2 from a config. Master weights stay fp32; autocast does the fp16 maths.
    config = GPT2Config(
        vocab_size=vocab,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=seq_len,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )
    model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = get_linear_schedule_with_warmup(optimizer, 5, args.steps)

    # prepare() after the scaler exists: it also keeps LayerNorms in fp32 and wraps the forward
    # in autocast.
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    scaler = accelerator.loss_scaler

    model.train()
    step = 0
    for (input_ids,) in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=input_ids, labels=input_ids).loss
            accelerator.backward(loss)  # scaled by S
            if accelerator.sync_gradients:
                if step + 1 == args.inject_overflow_at:  # demo: what an fp16 overflow looks like
                    accelerator.unwrap_model(model).lm_head.weight.grad[0, 0] = float("inf")
                # Unscales (once) and clips the true gradients; inf on an overflow step.
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()  # skipped entirely on inf/NaN gradients
            scheduler.step()  # held on a skipped step
            optimizer.zero_grad()

        if accelerator.sync_gradients:
            step += 1
            skipped = accelerator.optimizer_step_was_skipped
            accelerator.print(
                f"step {step:4d} | loss {loss.item():.4f} | grad norm {grad_norm.item():9.4f} | "
                f"loss scale {scaler.get_scale():8.0f} | lr {scheduler.get_last_lr()[0]:.2e}"
                + (" | skipped (overflow)" if skipped else "")
            )
            if step >= args.steps:
                break

    stats = scaler.stats
    accelerator.print(f"processes: {accelerator.num_processes}")
    accelerator.print(
        f"done: {stats.steps} steps, {stats.skipped} skipped, {stats.backoffs} backoffs, "
        f"{stats.growths} growths, final loss scale {stats.scale:g}"
    )
    accelerator.end_training()  # leaves the process group cleanly under `accelerate launch`


if __name__ == "__main__":
    main()
