#!/usr/bin/env python3
"""The bf16-on-CUDA half of issue 8's acceptance 1: the same tiny architectures as make_models.py
and make_moe_model.py (Qwen3-MoE), scaled to head_dim 64 (the CUDA attention kernels take head_dim
64/128/256), saved as bf16 safetensors folders with transformers' references, for
crates/engine/tests/hf_cuda.rs.

Per architecture, into OUT/ARCH-bf16/ (besides the folder itself):
  cuda_check.json           input ids, prompt, and 32 greedy tokens of the bf16 weights computed
                            in f32 by transformers
  ref_f32compute.f32.bin    transformers' logits of the bf16 weights computed in f32 (the yardstick:
                            same weights as quire reads)
  reference_bf16_logits.f32.bin  transformers computing in bf16 (reported beside it)

Run on the GPU machine (torch + transformers), then the Rust test:
  python3 tests/hf/cuda_check.py --out /tmp/hf-cuda
  QUIRE_HF_CUDA_DIR=/tmp/hf-cuda cargo test --release -p quire-engine --features cuda --test hf_cuda
"""

import argparse
import json
import os
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_models as mm  # noqa: E402
import make_moe_model as mmoe  # noqa: E402


BASE_CONFIGS = mm.arch_configs


def cuda_configs():
    """make_models' and make_moe_model's configs with wider heads (head_dim 64) and a wider model
    around them (the 8 experts 128 wide)."""
    out = {}
    bases = dict(BASE_CONFIGS())
    bases[mmoe.ARCH] = mmoe.moe_config()
    for arch, (cls, kw, pre) in bases.items():
        kw = dict(kw, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
        if "head_dim" in kw:
            kw["head_dim"] = 64
        if "moe_intermediate_size" in kw:
            kw["moe_intermediate_size"] = 128
        out[arch] = (cls, kw, pre)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch
    import transformers

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
    mm.arch_configs = cuda_configs  # build() reads the configs through this name
    # The experts' values under their per-expert names also when transformers holds them fused
    # (other names pass through to the plain generator).
    mm.gen_values = mmoe.expert_gen_values
    fixtures = tempfile.mkdtemp()
    for arch in sorted(cuda_configs()):
        mm.build(arch, fixtures, args.out, torch, transformers)
        ref = json.load(open(os.path.join(fixtures, arch, "reference.json")))
        bf16_dir = os.path.join(args.out, f"{arch}-bf16")
        model = mm.load_f32(transformers, torch, bf16_dir)  # bf16 weights, f32 compute
        ids = torch.tensor([ref["input_ids"]], dtype=torch.long)
        with torch.no_grad():
            logits = model(ids).logits[0].float()
            greedy, seq = [], list(ref["prompt_ids"])
            for _ in range(mm.N_GREEDY):
                nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
                greedy.append(nxt)
                seq.append(nxt)
        with open(os.path.join(bf16_dir, "ref_f32compute.f32.bin"), "wb") as f:
            f.write(struct.pack(f"<{logits.numel()}f", *logits.flatten().tolist()))
        check = {
            "arch": arch,
            "input_ids": ref["input_ids"],
            "prompt_ids": ref["prompt_ids"],
            "greedy_ids": greedy,
            "vocab": mm.VOCAB,
        }
        with open(os.path.join(bf16_dir, "cuda_check.json"), "w") as f:
            json.dump(check, f)
        print(f"  {arch}: bf16 folder with f32-compute references written")


if __name__ == "__main__":
    main()
