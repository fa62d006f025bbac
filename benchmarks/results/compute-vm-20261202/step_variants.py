# ruff: noqa  (the measurement scripts as they were run; see NOTE.md)
"""In-process step time of crnn_mobilenet_v3_small, batch 32: variants interleaved."""
import sys, time, statistics, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from scale_ocr.models import create_model
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
variants = sys.argv[2].split(",") if len(sys.argv) > 2 else ["base", "cl"]
arch = sys.argv[3] if len(sys.argv) > 3 else "crnn_mobilenet_v3_small"
torch.manual_seed(0)
x = torch.randn(32, 3, 32, 128)
tg = torch.randint(1, 100, (32, 8)); ln = torch.full((32,), 8)
models = {}
for v in variants:
    torch.manual_seed(0)
    m = create_model(arch, num_classes=120, input_size=(32, 128))
    if "cl" in v and "inp" not in v:
        m = m.to(memory_format=torch.channels_last)
    if "comp" in v:
        t0 = time.perf_counter(); m.compile(); 
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
    models[v] = (m, opt)
def step(v):
    m, opt = models[v]
    xi = x.contiguous(memory_format=torch.channels_last) if "cl" in v else x
    loss = m(xi, tg, ln)["loss"]
    loss.backward(); opt.step(); opt.zero_grad()
    return float(loss)
for v in variants:
    t0 = time.perf_counter(); step(v); step(v); print(v, "warmup", round(time.perf_counter() - t0, 1), flush=True)
times = {v: [] for v in variants}
for r in range(int(sys.argv[4]) if len(sys.argv) > 4 else 15):
    for v in variants:
        t0 = time.perf_counter(); step(v); times[v].append(time.perf_counter() - t0)
for v in variants:
    print(v, "median ms", round(1000 * statistics.median(times[v]), 1), "min", round(1000 * min(times[v]), 1))
