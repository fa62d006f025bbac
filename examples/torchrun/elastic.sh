#!/usr/bin/env bash
# Elastic scale-ocr training on 1 to 2 nodes, one rank per node, through torchrun's c10d rendezvous.
# Run the same script on every node; a node may leave (the others continue from the last checkpoint at the
# smaller world size) and a node may join later (picked up at the next restart):
#
#   RDZV_ENDPOINT=node0:29400 LOCAL_ADDR=<this node's address> OUTPUT_DIR=/shared/runs/elastic \
#       bash examples/torchrun/elastic.sh
#
# RDZV_ENDPOINT: HOST:PORT of the node that hosts the rendezvous (start it there first; it must stay up).
# LOCAL_ADDR:    the address the other nodes reach this one at (default: this host's name).
# OUTPUT_DIR:    one directory every node sees (a shared file system): checkpoints carry the job across
#                membership changes.
# The training flags are a small demonstration run; replace them with yours. docs/launchers.md
# ("torchrun across nodes, elastic") explains the rendezvous settings and what a membership change costs.
# tests/cluster/test_elastic.py runs this script on two simulated nodes, kills one and adds another;
# examples/k8s/pytorchjob.yaml runs the same command (tests/unit/test_k8s_manifest.py checks that).
set -euo pipefail
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=HOST:PORT, the node that hosts the rendezvous}"
: "${OUTPUT_DIR:?set OUTPUT_DIR to a directory that every node shares}"
LOCAL_ADDR="${LOCAL_ADDR:-$(hostname)}"
# torch 2.14's agents otherwise share one store across rounds, and a node that joins a later round waits forever
# for a key the first round wrote (docs/launchers.md); with this, rank 0 serves a fresh store every round.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
cd "$(dirname "$0")/../.."
exec torchrun --nnodes 1:2 --nproc_per_node 1 --max-restarts 3 \
    --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id scale-ocr-elastic --local_addr "$LOCAL_ADDR" \
    --rdzv_conf last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=3 \
    scale_ocr/train.py --strategy ddp --train-samples 1024 --val-samples 8 -b 4 --max-chars 5 --sched constant \
    --epochs 1 --max-steps 56 --save-every 8 --log-every 1 --dist-timeout 20 --wandb-mode disabled \
    --output-dir "$OUTPUT_DIR"
