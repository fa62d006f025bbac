#!/usr/bin/env bash
# scale-ocr across nodes under DeepSpeed's own launcher. Run it once, on a host that reaches every host of the
# hostfile by ssh without a password (it starts the ranks everywhere):
#
#   MASTER_ADDR=node1 OUTPUT_DIR=/shared/runs/ds bash examples/deepspeed/launch.sh                    # pdsh
#   LAUNCHER=openmpi MASTER_ADDR=node1 OUTPUT_DIR=/shared/runs/ds bash examples/deepspeed/launch.sh   # mpirun
#
# LAUNCHER:    pdsh (DeepSpeed's default: pdsh runs deepspeed.launcher.launch on each host over ssh, which starts
#              that host's ranks) or openmpi (mpirun starts every rank; it reads the same hostfile).
# HOSTFILE:    default examples/deepspeed/hostfile (`NAME slots=N` per host).
# MASTER_ADDR: an address of the first host that every host reaches (rank 0 serves the rendezvous there);
#              MASTER_PORT: default 29500. DeepSpeed's openmpi runner does not pass --master_addr/--master_port on,
#              so under openmpi they travel as mpirun -x variables.
# OUTPUT_DIR:  one directory every host mounts at the same path; ranks that do not see it stop at start.
# MPI_ARGS:    more mpirun arguments under openmpi (root needs --allow-run-as-root).
# The remote ranks get only what DeepSpeed's runner exports (docs/launchers.md, "DeepSpeed's multi-node
# launcher"): put WANDB_API_KEY, WANDB_MODE and the like in a .deepspeed_env file (KEY=VALUE lines) here or in ~.
# The training flags are a small demonstration run; replace them with yours, or add flags after the script's name
# (the last of a flag given twice wins). tests/cluster/test_deepspeed_launcher.py runs this script with both
# launchers on two simulated nodes.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the first host of the hostfile, as the other hosts reach it}"
: "${OUTPUT_DIR:?set OUTPUT_DIR to a directory that every host shares}"
cd "$(dirname "$0")/../.."
HOSTFILE="${HOSTFILE:-examples/deepspeed/hostfile}"
PORT="${MASTER_PORT:-29500}"
case "${LAUNCHER:-pdsh}" in
    pdsh) launch=(--master_addr "$MASTER_ADDR" --master_port "$PORT") ;;
    openmpi) launch=(--launcher openmpi "--launcher_args=-x MASTER_ADDR=$MASTER_ADDR -x MASTER_PORT=$PORT ${MPI_ARGS:-}") ;;
    *) echo "LAUNCHER=${LAUNCHER}: use pdsh or openmpi" >&2; exit 2 ;;
esac
exec deepspeed --hostfile "$HOSTFILE" "${launch[@]}" \
    scale_ocr/train.py --strategy zero2 --train-samples 32 --val-samples 8 -b 4 --max-chars 5 --max-steps 2 \
    --log-every 1 --lr 1e-3 --output-dir "$OUTPUT_DIR" "$@"
