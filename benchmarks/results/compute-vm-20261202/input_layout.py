# ruff: noqa  (the measurement scripts as they were run; see NOTE.md)
import sys, time, statistics, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from scale_ocr.cli_args import parse_config
from scale_ocr.tasks import create_task
torch.set_num_threads(1)
arch, size = sys.argv[1], sys.argv[2]
task = create_task(parse_config([arch, "--input-size", size, "--output-dir", "/tmp/mb/x"]).model)
res = {}
models = {}
for v in ("base", "clinp"):
    torch.manual_seed(0); m = task.create_model(); models[v] = (m, torch.optim.AdamW(m.parameters(), fused=True))
inp = task.dummy_inputs(int(sys.argv[3]))
def step(v):
    m, o = models[v]
    a = list(inp)
    if v == "clinp": a[0] = a[0].contiguous(memory_format=torch.channels_last)
    m(*a)["loss"].backward(); o.step(); o.zero_grad()
for v in models: step(v)
t = {v: [] for v in models}
for _ in range(int(sys.argv[4])):
    for v in models:
        t0 = time.perf_counter(); step(v); t[v].append(time.perf_counter() - t0)
for v in models: print(arch, v, round(1000 * statistics.median(t[v])), "ms")
