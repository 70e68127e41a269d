#!/usr/bin/env python3
"""Dev check (not a test dependency): a file written by quire-gguf's writer must
be readable by Python's `gguf` package with identical values, and quire's
quantizers must produce the same bytes as `gguf.quants`.

    cargo run -p quire-gguf --example write_sample -- /tmp/s.gguf [VERSION] [ALIGNMENT]
    python3 crates/gguf/scripts/check_python_gguf.py /tmp/s.gguf
"""
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType as VT, GGMLQuantizationType as QT
from gguf import quants

r = GGUFReader(sys.argv[1])


def scalar(name):
    f = r.fields[name]
    return f.parts[f.data[0]][0], f.types


def strings(name):
    f = r.fields[name]
    return [bytes(f.parts[i]).decode() for i in f.data]


expect = {
    "t.u8": (250, VT.UINT8), "t.i8": (-120, VT.INT8), "t.u16": (65000, VT.UINT16),
    "t.i16": (-32000, VT.INT16), "t.u32": (4000000000, VT.UINT32),
    "t.i32": (-2000000000, VT.INT32), "t.u64": (2**64 - 2, VT.UINT64),
    "t.i64": (-(2**63) + 1, VT.INT64), "t.f32": (0.5, VT.FLOAT32),
    "t.f64": (0.25, VT.FLOAT64), "t.bool": (True, VT.BOOL),
}
for k, (v, t) in expect.items():
    got, types = scalar(k)
    assert got == v and types == [t], (k, got, types)
assert strings("general.architecture") == ["llama"]
assert strings("t.string") == ["héllo \U0001F980"]
assert strings("t.strings") == ["a", "", "ü"], strings("t.strings")
f = r.fields["t.i32s"]
assert f.types == [VT.ARRAY, VT.INT32] and [int(f.parts[i][0]) for i in f.data] == [1, -2, 3]
assert r.fields["t.nested"].types[:2] == [VT.ARRAY, VT.ARRAY]
print("metadata ok; alignment", r.alignment, "data offset", r.data_offset)

tensors = {t.name: t for t in r.tensors}
src = np.asarray(tensors["src"].data, dtype=np.float32).reshape(4, 64)
for name in ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]:
    t = tensors[name]
    assert t.tensor_type == QT[name] and list(t.shape) == [64, 4], (name, t.tensor_type, t.shape)
    ours = np.asarray(t.data).view(np.uint8).tobytes()
    theirs = quants.quantize(src, QT[name]).view(np.uint8).tobytes()
    same = ours == theirs
    deq = quants.dequantize(np.frombuffer(ours, dtype=np.uint8), QT[name]).reshape(-1)
    err = float(np.max(np.abs(deq - src.reshape(-1))))
    print(f"{name}: bytes identical to gguf.quants: {same}; max |dequant - src| = {err:.4g}")
    assert same, name
print("all ok")
