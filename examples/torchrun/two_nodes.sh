#!/usr/bin/env bash
# scale-ocr on exactly 2 nodes, one rank per node (torchrun's static rendezvous). Run on both nodes:
#
#   MASTER_ADDR=node0 NODE_RANK=0 OUTPUT_DIR=/shared/runs/two bash examples/torchrun/two_nodes.sh   # on node0
#   MASTER_ADDR=node0 NODE_RANK=1 OUTPUT_DIR=/shared/runs/two bash examples/torchrun/two_nodes.sh   # on node1
#
# MASTER_ADDR: the node with NODE_RANK 0 (it serves the rendezvous); MASTER_PORT: default 29500.
# OUTPUT_DIR:  one directory both nodes see. A rank that dies makes both agents restart every worker (up to
#              --max-restarts times) and the job continues from the newest checkpoint at the same world size;
#              a node that is gone for good ends the job: examples/torchrun/elastic.sh continues without it.
# The training flags are a small demonstration run; replace them with yours. These are the flags of
# tests/distributed/test_faults.py's two-node test (a rank killed mid-run, the job ends with an uninterrupted
# run's weights); tests/unit/test_k8s_manifest.py checks that both parsers accept them.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the node with NODE_RANK 0}"
: "${NODE_RANK:?set NODE_RANK to 0 on the first node and 1 on the second}"
: "${OUTPUT_DIR:?set OUTPUT_DIR to a directory that both nodes share}"
cd "$(dirname "$0")/../.."
exec torchrun --nnodes 2 --node_rank "$NODE_RANK" --nproc_per_node 1 --max-restarts 2 \
    --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}" \
    scale_ocr/train.py --strategy ddp --train-samples 64 --val-samples 8 -b 4 --max-chars 5 --sched constant \
    --epochs 1 --log-every 1 --save-every 2 --dist-timeout 10 --wandb-mode disabled --output-dir "$OUTPUT_DIR"
