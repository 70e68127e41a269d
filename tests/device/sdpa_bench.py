"""PyTorch's dense scaled_dot_product_attention for decode, timed with CUDA events (the peer
for `quire attn-bench --backend cuda`). Usage: sdpa_bench.py B L HQ HKV D DTYPE [REPEATS]"""
import sys, torch
import torch.nn.functional as F

b, l, hq, hkv, d = map(int, sys.argv[1:6])
dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[sys.argv[6]]
reps = int(sys.argv[7]) if len(sys.argv) > 7 else 200
q = torch.randn(b, hq, 1, d, device="cuda", dtype=dtype)
k = torch.randn(b, hkv, l, d, device="cuda", dtype=dtype)
v = torch.randn(b, hkv, l, d, device="cuda", dtype=dtype)
f = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=hkv != hq)
for _ in range(10):
    f()
torch.cuda.synchronize()
ts = []
for _ in range(reps):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); f(); e.record()
    torch.cuda.synchronize()
    ts.append(s.elapsed_time(e))
ts.sort()
med = ts[len(ts) // 2]
by = 2 * b * hkv * l * d * q.element_size() + 2 * b * hq * d * q.element_size()
print(f"SDPA B{b} L{l} Hq{hq} Hkv{hkv} D{d} {sys.argv[6]}: median {med*1e3:.1f} us, p10 {ts[len(ts)//10]*1e3:.1f}, p90 {ts[9*len(ts)//10]*1e3:.1f}, {by/med/1e9:.3f} TB/s")
