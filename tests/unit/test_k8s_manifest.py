"""examples/k8s/pytorchjob.yaml runs the tested elastic command: its container's command is the torchrun command of
examples/torchrun/elastic.sh (which tests/cluster/test_elastic.py runs on two simulated nodes), apart from the
addresses the operator and the pod fill in, and the operator's elastic policy says what its flags say. The
two-node scripts' commands parse with torchrun's parser and scale-ocr's. An elastic job that lacks the scripts'
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is warned that a joining node would hang it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from torch.distributed.run import get_args_parser

from scale_ocr.cli.args import parse_config
from scale_ocr.distributed.round_store import join_warning, node_range

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "examples" / "k8s" / "pytorchjob.yaml"
ELASTIC = ROOT / "examples" / "torchrun" / "elastic.sh"
STATIC = ROOT / "examples" / "torchrun" / "two_nodes.sh"
TRAIN = "scale_ocr/train.py"


def script_command(script: Path, tmp: Path, **env: str) -> tuple[list[str], str]:
    """The arguments ``script`` hands torchrun, and the TORCH_DISABLE_SHARE_RDZV_TCP_STORE it exports: the script
    runs with a stand-in ``torchrun`` first on PATH that records both."""
    stub, record = tmp / "bin" / "torchrun", tmp / "argv"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text('#!/bin/sh\nprintf "%s\\0" "$TORCH_DISABLE_SHARE_RDZV_TCP_STORE" "$@" > "$ARGV_FILE"\n')
    stub.chmod(0o755)
    run_env = {"PATH": f"{stub.parent}:{os.environ['PATH']}", "ARGV_FILE": str(record), **env}
    done = subprocess.run(["bash", str(script)], env=run_env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    share, *argv = record.read_text().split("\0")[:-1]
    return argv, share


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    """torchrun's own flags, and the training script's."""
    at = argv.index(TRAIN)
    return argv[:at], argv[at + 1:]


@pytest.fixture(scope="module")
def manifest() -> tuple[dict, dict]:
    job, claim = yaml.safe_load_all(MANIFEST.read_text())
    return job, claim


def test_manifest_runs_the_tested_elastic_command(manifest, tmp_path):
    job, claim = manifest
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "pytorch"  # the container the operator gives its PET_* variables to
    filled = {"PET_RDZV_ENDPOINT": "scale-ocr-elastic-worker-0:29400", "POD_IP": "10.1.2.3"}
    command = [re.sub(r"\$\((\w+)\)", lambda m: filled[m.group(1)], str(a)) for a in container["command"]]
    mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["runs"]
    tested, share = script_command(ELASTIC, tmp_path, RDZV_ENDPOINT=filled["PET_RDZV_ENDPOINT"],
                                   LOCAL_ADDR=filled["POD_IP"], OUTPUT_DIR=f"{mount}/elastic")
    assert command == ["torchrun", *tested]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == share == "1"
    assert {e["name"]: e.get("valueFrom") for e in container["env"]}["POD_IP"] == {
        "fieldRef": {"fieldPath": "status.podIP"}}

    launch, train = split(command[1:])
    flags = get_args_parser().parse_args([*launch, TRAIN, *train])
    policy = job["spec"]["elasticPolicy"]
    assert f"{policy['minReplicas']}:{policy['maxReplicas']}" == flags.nnodes == "1:2"
    assert (policy["rdzvBackend"], policy["rdzvId"], policy["maxRestarts"]) == (
        flags.rdzv_backend, flags.rdzv_id, flags.max_restarts)
    assert policy["minReplicas"] <= job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] <= policy["maxReplicas"]
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["pytorchjob-port"]
    assert filled["PET_RDZV_ENDPOINT"].endswith(f":{port}")

    cfg = parse_config(train)
    assert cfg.output.output_dir.startswith(f"{mount}/")  # on the volume every pod shares
    volume = {v["name"]: v for v in pod["volumes"]}["runs"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_two_node_scripts_parse_with_torchrun_and_scale_ocr(tmp_path):
    for script, env in ((ELASTIC, {"RDZV_ENDPOINT": "node0:29400", "LOCAL_ADDR": "node1"}),
                        (STATIC, {"MASTER_ADDR": "node0", "NODE_RANK": "1"})):
        argv, _ = script_command(script, tmp_path, OUTPUT_DIR=str(tmp_path / "run"), **env)
        launch, train = split(argv)
        flags = get_args_parser().parse_args(argv)
        assert flags.training_script == TRAIN and flags.nproc_per_node == "1", script
        assert parse_config(train).output.output_dir == str(tmp_path / "run"), script
    assert (flags.nnodes, flags.node_rank, flags.master_addr, flags.master_port) == ("2", 1, "node0", 29500)


def test_scripts_refuse_a_missing_setting_in_one_line(tmp_path):
    done = subprocess.run(["bash", str(ELASTIC)], env={"PATH": os.environ["PATH"], "OUTPUT_DIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and done.stderr.count("\n") == 1 and "RDZV_ENDPOINT" in done.stderr, done.stderr


SHARED = {"TORCHELASTIC_USE_AGENT_STORE": "True"}  # what torchrun's agent tells its workers by default


@pytest.mark.parametrize("argv,env,nodes", [
    (["torchrun", "--nnodes", "1:2", "train.py"], SHARED, (1, 2)),
    (["torchrun", "--nnodes=2:4", "train.py"], SHARED, (2, 4)),
    (["torchrun", "train.py"], {**SHARED, "PET_NNODES": "1:3"}, (1, 3)),  # the operator's variable
    (["torchrun", "--nnodes", "2", "train.py"], {**SHARED, "PET_NNODES": "1:3"}, None),  # the flag wins
    (["torchrun", "--nnodes", "2:2", "train.py"], SHARED, None),
    (["torchrun", "--nproc_per_node", "2", "train.py"], SHARED, None),
])
def test_an_elastic_job_sharing_one_store_is_warned_that_a_join_would_hang(argv, env, nodes):
    assert node_range(argv, env) == nodes
    line = join_warning(argv, env)
    if nodes is None:
        assert line is None
    else:
        assert f"--nnodes {nodes[0]}:{nodes[1]}" in line and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line
        assert join_warning(argv, {**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # what the scripts set
