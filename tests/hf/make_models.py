#!/usr/bin/env python3
"""Builds tiny random-weight Hugging Face models (Llama, Qwen2, Qwen3, Mistral) with transformers
and records transformers' outputs, so that quire's HF-folder loader and CPU backend can be checked
against transformers without torch on the test machine.

Why the weights are not committed: every parameter is set from a portable generator keyed by the
tensor name (splitmix64 over FNV-1a of the name; see `gen_values`). The Rust test
(crates/model/tests/hf_parity.rs, helper crates/model/tests/hf_common/mod.rs) re-creates the exact
same f32 safetensors from `manifest.json`, so the repository carries only the config, the tokenizer
files and transformers' reference outputs.

Per architecture it writes into FIXTURES/ARCH/ (default tests/hf/fixtures/ARCH/):
  config.json, generation_config.json     as transformers saved them
  tokenizer.json, tokenizer_config.json   a tiny hand-written byte-level BPE (+ chat template)
  manifest.json                           tensor names, shapes, dtypes and generator parameters
  reference.json                          text, its token ids, the input ids, the greedy prompt and
                                          32 greedy tokens, versions
  logits.f32.bin                          transformers' f32 logits of every input position,
                                          little-endian, [n_tokens, vocab] row-major
and the full model folders (safetensors, f32 and bf16) into OUT/ARCH-f32/ and OUT/ARCH-bf16/
for the CUDA check (OUT/ARCH-bf16/reference_bf16_logits.f32.bin: transformers' own bf16 logits
on CPU, to calibrate the bf16 tolerance).

Run (GPU machine, torch + transformers; the forward passes run on the CPU in float32):
  python3 tests/hf/make_models.py --out /tmp/hf-models [--fixtures tests/hf/fixtures] [--arch llama]
The script checks itself: it reloads each saved folder with transformers and requires identical
logits, and it checks that the saved tensors equal the generator's values.
"""

import argparse
import json
import os
import struct
import sys

MASK64 = (1 << 64) - 1
SEED = 0x5155495245  # "QUIRE"
GOLDEN = 0x9E3779B97F4A7C15


# ---------------------------------------------------------------- portable generator (keep in sync
# with crates/model/tests/hf_common/mod.rs)


def splitmix64(z):
    """One splitmix64 step: returns the output for state `z` (the state advance is included)."""
    z = (z + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def fnv1a64(s):
    h = 0xCBF29CE484222325
    for b in s.encode("utf-8"):
        h ^= b
        h = (h * 0x100000001B3) & MASK64
    return h


def gen_values(name, n, offset, scale):
    """Element i of tensor `name` (row-major) = offset + scale * (2u - 1), u = top 24 bits of
    splitmix64(key + i) / 2^24, key = splitmix64(SEED ^ fnv1a64(name)); computed in f64, then
    rounded once to f32 (by torch)."""
    key = splitmix64(SEED ^ fnv1a64(name))
    out = [0.0] * n
    for i in range(n):
        r = splitmix64((key + i) & MASK64)
        u = (r >> 40) / 16777216.0
        out[i] = offset + scale * (2.0 * u - 1.0)
    return out


def gen_params(name):
    """(offset, scale) of a tensor, by its role."""
    if name.endswith("norm.weight"):
        return 1.0, 0.25
    if name.endswith(".bias"):
        return 0.0, 0.125
    if name.endswith("embed_tokens.weight"):
        return 0.0, 1.0
    return 0.0, 0.25


# ---------------------------------------------------------------- tokenizer


def bytes_to_unicode():
    """GPT-2's byte -> printable character map."""
    printable = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {}
    n = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

WORDS = (
    "Ġthe Ġquick Ġbrown Ġfox Ġjumps Ġover Ġlazy Ġdog Ġand Ġtheory Ġsaid Ġit Ġis Ġin Ġof Ġto ing er"
    " on an Ġwas Ġwith Ġfor Ġthat Ġmodel Ġtoken Ġquire Ġworld Ġhello The Hello"
).split()

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)


def make_tokenizer(vocab_size, pre):
    """A byte-level BPE with exactly `vocab_size` tokens: 256 bytes, merges, 3 specials at the end."""
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    n_merges = vocab_size - 256 - len(SPECIALS)
    merges = []
    for word in WORDS:
        cur = word[0]
        for ch in word[1:]:
            nxt = cur + ch
            if nxt not in vocab and len(merges) < n_merges:
                merges.append(cur + " " + ch)
                vocab[nxt] = len(vocab)
            cur = nxt
    if len(merges) != n_merges:
        raise SystemExit(f"only {len(merges)} merges for {n_merges} slots: add words")
    added = []
    for s in SPECIALS:
        added.append(
            {
                "id": len(vocab),
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
        vocab[s] = len(vocab)
    assert len(vocab) == vocab_size
    if pre == "gpt2":
        pre_tok = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    else:
        regex = {"qwen2": QWEN2_SPLIT, "llama3": LLAMA3_SPLIT}[pre]
        pre_tok = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": pre_tok,
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": pre == "llama3",
            "vocab": {k: v for k, v in sorted(vocab.items(), key=lambda kv: kv[1]) if v < 256 + n_merges},
            "merges": merges,
        },
    }


def write_tokenizer_files(d, pre):
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIALS[0],
        "eos_token": SPECIALS[2],
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 256,
        "chat_template": CHATML,
    }
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(make_tokenizer(VOCAB, pre), f, ensure_ascii=False, indent=1)
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(tok_cfg, f, ensure_ascii=False, indent=1)


# ---------------------------------------------------------------- models

VOCAB = 320
TEXT = (
    "The quick brown fox jumps over the lazy dog, and the theory said: it's 2024!\n"
    "Hello  world\t<|im_end|> model token quire 12345."
)
N_GREEDY = 32
PROMPT_LEN = 8


def arch_configs():
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=VOCAB - 3,
        eos_token_id=VOCAB - 1,
        hidden_act="silu",
    )
    return {
        # Llama 3 style: untied output, no bias, Llama 3 RoPE frequency scaling, Llama 3 split.
        "llama": (
            "LlamaConfig",
            dict(
                common,
                num_hidden_layers=3,
                tie_word_embeddings=False,
                attention_bias=False,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
            "llama3",
        ),
        # Qwen2: QKV bias, tied embeddings, sliding_window set but use_sliding_window false.
        "qwen2": (
            "Qwen2Config",
            dict(common, tie_word_embeddings=True, use_sliding_window=False, sliding_window=4, max_window_layers=1),
            "qwen2",
        ),
        # Qwen3: QK-norm, explicit head_dim (32) != hidden / heads (16), tied embeddings.
        "qwen3": (
            "Qwen3Config",
            dict(common, head_dim=32, tie_word_embeddings=True, attention_bias=False, use_sliding_window=False),
            "qwen2",
        ),
        # Mistral: a sliding window of 8, which matters over the ~50 input tokens.
        "mistral": (
            "MistralConfig",
            dict(common, head_dim=16, tie_word_embeddings=False, sliding_window=8),
            "gpt2",
        ),
    }


def rel_err(a, b):
    """max over rows of max|a-b| / max|b|."""
    return float(((a - b).abs().amax(dim=-1) / b.abs().amax(dim=-1)).max())


def load_f32(transformers, torch, path):
    """from_pretrained in float32 with eager attention, across transformers versions (`dtype` is
    the newer name of `torch_dtype`)."""
    for kw in ("dtype", "torch_dtype"):
        try:
            m = transformers.AutoModelForCausalLM.from_pretrained(
                path, attn_implementation="eager", **{kw: torch.float32}
            )
            return m.float().eval()
        except TypeError:
            continue
    return transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()


def save(model, path):
    try:
        model.save_pretrained(path, safe_serialization=True)
    except TypeError:  # releases where safetensors is the only format
        model.save_pretrained(path)


def build(arch, fixtures, out, torch, transformers):
    cls_name, cfg_kw, pre = arch_configs()[arch]
    cfg = getattr(transformers, cls_name)(**cfg_kw)
    try:
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    except TypeError:
        cfg._attn_implementation = "eager"
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = model.float().eval()

    # Every parameter from the generator (tied weights appear once, under the embedding's name).
    with torch.no_grad():
        for name, p in model.named_parameters():
            off, scale = gen_params(name)
            vals = gen_values(name, p.numel(), off, scale)
            p.copy_(torch.tensor(vals, dtype=torch.float64).to(torch.float32).reshape(p.shape))

    fx = os.path.join(fixtures, arch)
    os.makedirs(fx, exist_ok=True)
    f32_dir = os.path.join(out, f"{arch}-f32")
    bf16_dir = os.path.join(out, f"{arch}-bf16")

    for d in (fx, f32_dir, bf16_dir):
        write_tokenizer_files(d, pre)

    import tokenizers

    tk = tokenizers.Tokenizer.from_file(os.path.join(fx, "tokenizer.json"))
    text_ids = tk.encode(TEXT, add_special_tokens=False).ids
    input_ids = [cfg.bos_token_id] + text_ids
    prompt = input_ids[:PROMPT_LEN]

    # Reference forward (CPU, f32, eager) over all positions.
    ids_t = torch.tensor([input_ids], dtype=torch.long)
    with torch.no_grad():
        logits = model(ids_t).logits[0].float()
    # Qwen2 sets sliding_window with use_sliding_window=false: no window may apply. Some
    # transformers releases applied it anyway; say so loudly (quire follows the config's meaning).
    if arch == "qwen2":
        no_win = transformers.Qwen2Config(**dict(cfg_kw, sliding_window=None))
        try:
            ref = transformers.AutoModelForCausalLM.from_config(no_win, attn_implementation="eager")
        except TypeError:
            no_win._attn_implementation = "eager"
            ref = transformers.AutoModelForCausalLM.from_config(no_win)
        ref = ref.float().eval()
        ref.load_state_dict(model.state_dict())
        with torch.no_grad():
            same = torch.equal(ref(ids_t).logits[0].float(), logits)
        print(f"  qwen2: sliding_window ignored when use_sliding_window=false: {same}")
        if not same:
            print("  WARNING: this transformers applies Qwen2's sliding window although "
                  "use_sliding_window=false; the qwen2 fixture will not match quire")
    print(f"  {arch}: config.sliding_window = {getattr(model.config, 'sliding_window', None)}")

    # Greedy: full recomputation each step (no cache, no EOS stop), the plainest definition.
    greedy = []
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(N_GREEDY):
            nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            greedy.append(nxt)
            seq.append(nxt)
    # Cross-check with generate() (suppressing EOS so that all 32 tokens come).
    try:
        with torch.no_grad():
            g = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=N_GREEDY,
                min_new_tokens=N_GREEDY,
                do_sample=False,
                pad_token_id=cfg.eos_token_id,
            )[0, len(prompt):].tolist()
        # The plain loop is the reference; a difference is reported, not fatal.
        print(f"  {arch}: generate() {'agrees' if g == greedy else 'DIFFERS (WARNING): ' + str(g)}")
    except Exception as e:  # older transformers: report, keep the plain loop's tokens
        print(f"  {arch}: generate() cross-check skipped: {e!r}")

    # Save f32 and bf16 folders; config and generation config go to the fixture too.
    save(model, f32_dir)
    for name in ("config.json", "generation_config.json"):
        src = os.path.join(f32_dir, name)
        if os.path.exists(src):
            with open(src, encoding="utf-8") as f:
                data = f.read()
            with open(os.path.join(fx, name), "w", encoding="utf-8") as f:
                f.write(data)
    model_bf16 = load_f32(transformers, torch, f32_dir).to(torch.bfloat16)
    save(model_bf16, bf16_dir)
    with torch.no_grad():
        logits_bf16 = model_bf16(ids_t).logits[0].float()
    with open(os.path.join(bf16_dir, "reference_bf16_logits.f32.bin"), "wb") as f:
        f.write(struct.pack(f"<{logits_bf16.numel()}f", *logits_bf16.flatten().tolist()))

    # Manifest from the saved file (what a loader sees), checked against the generator.
    from safetensors import safe_open

    tensors = []
    st_files = sorted(x for x in os.listdir(f32_dir) if x.endswith(".safetensors"))
    for stf in st_files:
        with safe_open(os.path.join(f32_dir, stf), framework="pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name)
                off, scale = gen_params(name)
                want = torch.tensor(gen_values(name, t.numel(), off, scale), dtype=torch.float64)
                want = want.to(torch.float32).reshape(t.shape)
                if t.dtype != torch.float32 or not torch.equal(t, want):
                    raise SystemExit(f"{arch}: saved tensor {name} differs from the generator")
                tensors.append({"name": name, "shape": list(t.shape), "dtype": "F32", "offset": off, "scale": scale})
    manifest = {
        "seed": SEED,
        "generator": "splitmix64/fnv1a64, see tests/hf/make_models.py gen_values",
        "tensors": tensors,
    }
    with open(os.path.join(fx, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)

    # Self-check: the saved folder reloads to the same logits.
    again = load_f32(transformers, torch, f32_dir)
    with torch.no_grad():
        logits2 = again(ids_t).logits[0].float()
    if not torch.equal(logits, logits2):
        raise SystemExit(f"{arch}: reloaded model gives different logits")

    with open(os.path.join(fx, "logits.f32.bin"), "wb") as f:
        f.write(struct.pack(f"<{logits.numel()}f", *logits.flatten().tolist()))
    ref = {
        "arch": arch,
        "text": TEXT,
        "text_ids": text_ids,
        "input_ids": input_ids,
        "logits_file": "logits.f32.bin",
        "logits_shape": [len(input_ids), VOCAB],
        "prompt_ids": prompt,
        "greedy_ids": greedy,
        "chat_template_render": None,
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
    }
    # The chat template as transformers renders it, if the tokenizer loads through AutoTokenizer.
    try:
        at = transformers.AutoTokenizer.from_pretrained(fx)
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
        ref["chat_template_render"] = at.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        if at.encode(TEXT, add_special_tokens=False) != text_ids:
            raise SystemExit(f"{arch}: AutoTokenizer and tokenizers disagree on the text")
    except SystemExit:
        raise
    except Exception as e:
        print(f"  {arch}: AutoTokenizer check skipped: {e!r}")
    with open(os.path.join(fx, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(ref, f, ensure_ascii=False, indent=1)

    print(
        f"  {arch}: {len(tensors)} tensors, {len(input_ids)} input tokens, greedy {greedy[:8]}..., "
        f"bf16-vs-f32 transformers rel err {rel_err(logits_bf16, logits):.3e}, "
        f"logit range [{float(logits.min()):.3f}, {float(logits.max()):.3f}]"
    )


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="where the full f32/bf16 model folders go")
    ap.add_argument("--fixtures", default=os.path.join(here, "fixtures"))
    ap.add_argument("--arch", action="append", choices=sorted(arch_configs()), help="default: all")
    ap.add_argument("--self-test", action="store_true", help="print generator values and exit (no torch)")
    ap.add_argument(
        "--tokenizers-only",
        action="store_true",
        help="write only tokenizer.json and tokenizer_config.json into the fixtures (no torch)",
    )
    args = ap.parse_args()
    if args.tokenizers_only:
        for arch in args.arch or sorted(arch_configs()):
            write_tokenizer_files(os.path.join(args.fixtures, arch), arch_configs()[arch][2])
        return
    if args.self_test:
        print(json.dumps(gen_values("model.norm.weight", 4, 1.0, 0.25)))
        print(json.dumps(gen_values("lm_head.weight", 4, 0.0, 0.25)))
        print(json.dumps(make_tokenizer(VOCAB, "qwen2")["model"]["merges"][:8]))
        return

    import torch
    import transformers

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(16, os.cpu_count() or 1)))
    for arch in args.arch or sorted(arch_configs()):
        build(arch, args.fixtures, args.out, torch, transformers)
    print("ok")


if __name__ == "__main__":
    main()
