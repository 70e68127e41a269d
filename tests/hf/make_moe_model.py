#!/usr/bin/env python3
"""Builds a tiny random-weight Qwen3MoeForCausalLM with transformers and records its outputs, in
the same fixture format as tests/hf/make_models.py (whose generator, tokenizer and `build` it
reuses), into FIXTURES/qwen3_moe/ and OUT/qwen3_moe-{f32,bf16}/.

Why a separate script: the experts need one more rule. The checkpoint format (what Qwen3-MoE
checkpoints on the Hub and transformers' save_pretrained write) has one tensor per expert,
`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, and every value comes from the portable
generator under that per-expert name. transformers v5 holds the experts fused in the module
(`mlp.experts.gate_up_proj` [E, 2I, H]: gate rows then up rows per expert; `mlp.experts.down_proj`
[E, H, I]) and converts back to per-expert tensors on save; v4 holds per-expert modules. Both are
filled from the per-expert names, so manifest.json lists per-expert tensors either way and the Rust
harness regenerates them with the plain per-name rule.

The script checks itself beyond make_models.py's checks: after building, it recomputes layer 0's
MoE block from the generator's per-expert values with an independent reference (softmax, top-k,
renormalization, SwiGLU experts) and requires it to match transformers' module on random inputs.

Run (GPU machine, torch + transformers; forward passes on the CPU in float32):
  python3 tests/hf/make_moe_model.py --out /tmp/hf-models [--fixtures tests/hf/fixtures]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_models as mm  # noqa: E402

ARCH = "qwen3_moe"
NUM_EXPERTS = 8
TOP_K = 2
MOE_INTER = 32
HIDDEN = 64


def moe_config():
    return (
        "Qwen3MoeConfig",
        dict(
            hidden_size=HIDDEN,
            intermediate_size=128,  # dense MLP size: unused, every layer is sparse
            moe_intermediate_size=MOE_INTER,
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=mm.VOCAB,
            max_position_embeddings=256,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            bos_token_id=mm.VOCAB - 3,
            eos_token_id=mm.VOCAB - 1,
            hidden_act="silu",
            tie_word_embeddings=False,
            attention_bias=False,
            use_sliding_window=False,
        ),
        "qwen2",
    )


_plain_gen_values = mm.gen_values


def expert_gen_values(name, n, offset, scale):
    """The generator, extended to transformers v5's fused expert parameters: their values are the
    per-expert tensors' generator values, stacked in the module's layout."""
    if name.endswith("mlp.experts.gate_up_proj"):
        prefix = name[: -len("gate_up_proj")]
        # Sizes from n, so that scaled copies of the model (tests/hf/cuda_check.py) work too.
        assert n % (2 * NUM_EXPERTS) == 0, (name, n)
        per = n // (2 * NUM_EXPERTS)
        out = []
        for e in range(NUM_EXPERTS):
            for part in ("gate_proj", "up_proj"):
                pname = f"{prefix}{e}.{part}.weight"
                out += _plain_gen_values(pname, per, *mm.gen_params(pname))
        return out
    if name.endswith("mlp.experts.down_proj"):
        prefix = name[: -len("down_proj")]
        assert n % NUM_EXPERTS == 0, (name, n)
        per = n // NUM_EXPERTS
        out = []
        for e in range(NUM_EXPERTS):
            pname = f"{prefix}{e}.down_proj.weight"
            out += _plain_gen_values(pname, per, *mm.gen_params(pname))
        return out
    return _plain_gen_values(name, n, offset, scale)


def check_moe_block(torch, transformers, f32_dir):
    """Layer 0's sparse block against a reference from the per-expert generator values."""
    model = mm.load_f32(transformers, torch, f32_dir)
    block = model.model.layers[0].mlp
    pre = "model.layers.0.mlp"

    def gen(name, shape):
        vals = _plain_gen_values(name, int(torch.tensor(shape).prod()), *mm.gen_params(name))
        return torch.tensor(vals, dtype=torch.float64).to(torch.float32).reshape(shape).double()

    router = gen(f"{pre}.gate.weight", (NUM_EXPERTS, HIDDEN))
    gate = [gen(f"{pre}.experts.{e}.gate_proj.weight", (MOE_INTER, HIDDEN)) for e in range(NUM_EXPERTS)]
    up = [gen(f"{pre}.experts.{e}.up_proj.weight", (MOE_INTER, HIDDEN)) for e in range(NUM_EXPERTS)]
    down = [gen(f"{pre}.experts.{e}.down_proj.weight", (HIDDEN, MOE_INTER)) for e in range(NUM_EXPERTS)]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 9, HIDDEN, generator=g)
    with torch.no_grad():
        got = block(x)
    got = (got[0] if isinstance(got, tuple) else got).reshape(9, HIDDEN).double()
    xs = x.reshape(9, HIDDEN).double()
    want = torch.zeros_like(xs)
    for t in range(9):
        p = torch.softmax(xs[t] @ router.T, dim=-1)
        w, idx = torch.sort(p, descending=True, stable=True)
        w, idx = w[:TOP_K], idx[:TOP_K]
        w = w / w.sum()
        for wk, e in zip(w.tolist(), idx.tolist()):
            h = torch.nn.functional.silu(gate[e] @ xs[t]) * (up[e] @ xs[t])
            want[t] += wk * (down[e] @ h)
    err = float((got - want).abs().max() / want.abs().max())
    if err > 1e-5:
        raise SystemExit(f"{ARCH}: transformers' MoE block differs from the reference (rel err {err:.2e})")
    print(f"  {ARCH}: MoE block matches the per-expert reference (rel err {err:.1e})")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="where the full f32/bf16 model folders go")
    ap.add_argument("--fixtures", default=os.path.join(here, "fixtures"))
    args = ap.parse_args()

    import torch
    import transformers

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(16, os.cpu_count() or 1)))
    configs = mm.arch_configs()
    configs[ARCH] = moe_config()
    mm.arch_configs = lambda: configs
    mm.gen_values = expert_gen_values
    mm.build(ARCH, args.fixtures, args.out, torch, transformers)
    check_moe_block(torch, transformers, os.path.join(args.out, f"{ARCH}-f32"))
    # The manifest must describe the checkpoint format (per-expert tensors).
    import json

    with open(os.path.join(args.fixtures, ARCH, "manifest.json"), encoding="utf-8") as f:
        names = [t["name"] for t in json.load(f)["tensors"]]
    if any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in names):
        raise SystemExit(f"{ARCH}: saved checkpoint has fused expert tensors; expected per-expert tensors")
    n_exp = sum(".experts." in n for n in names)
    print(f"  {ARCH}: manifest has {len(names)} tensors ({n_exp} per-expert)")
    print("ok")


if __name__ == "__main__":
    main()
