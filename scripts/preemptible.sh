#!/usr/bin/env bash
# Run a training command (torchrun ..., accelerate launch ..., python ...) so that a SIGTERM
# (a preemption, Kubernetes' pod termination) ends this script with 143, whatever the launcher
# returns. torchrun passes the signal on to its ranks (each saves its checkpoint and exits 143
# with --enable_jit_checkpoint) but itself exits 1 after torch's SignalException traceback, so a
# restart policy on 143 would never match. Usage, as the container's main process:
#   exec scripts/preemptible.sh torchrun --nproc_per_node 2 recipes/finetune_bert.py ...
set -u
child=""
trap 'if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null; wait "$child"; fi; exit 143' TERM
"$@" &
child=$!
wait "$child"
