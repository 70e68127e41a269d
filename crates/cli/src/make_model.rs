//! `quire make-model`: a GGUF file with the shapes, metadata and a synthetic tokenizer of a real
//! model but random weights, so that one file can be given to quire and to llama.cpp for speed
//! comparisons on a machine with no network and no real weights (speed does not depend on the
//! values).
//!
//! Speed of writing matters (an 8B f16 file is 16 GB): each weight type gets one random pattern of
//! about 1 MiB (an odd number of blocks, so rows of power-of-two width do not line up with it),
//! quantized once and then repeated from a random block offset in every tensor, streamed through
//! [`GgufWriter::write_to_with`]. The file is never held in memory. The values (normal, std 0.02;
//! norm weights 1.0) keep activations finite through every layer in quire and llama.cpp alike.

use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use quire_gguf::{quantize_row, GgmlType, GgufError, GgufWriter, Value};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

pub use crate::presets::Preset;
use crate::presets::Shape;

/// Standard deviation of every random weight: activations grow by about `0.02 * sqrt(fan_in)` per
/// matrix (0.5 to 2.4 for these presets), and RMS norms reset them before each block.
const WEIGHT_STD: f32 = 0.02;
/// Approximate size of the repeated random pattern.
const PATTERN_BYTES: usize = 1 << 20;
/// Write buffer: large writes reach the OS in few system calls.
const BUFFER_BYTES: usize = 16 << 20;

/// Shown after the options by `--help` (the variant's doc line in main.rs is the about text, and
/// clap lets it replace a long_about given here).
const LONG_ABOUT: &str = "Writes a GGUF model with the exact shapes and metadata of a known \
model but random weights, for speed comparisons: the same file runs in quire and in llama.cpp \
(llama-bench, llama-cli), and speed does not depend on weight values. Text generated from it is \
gibberish; perplexity is about the vocabulary size.\n\n\
Weights are normal(0, 0.02) in the chosen type (token_embd and output too), norm weights are f32 \
1.0, so activations stay finite through every layer. The data is one random ~1 MiB pattern \
repeated from a different offset in each tensor, streamed to disk: writing runs at disk speed.\n\n\
The tokenizer is synthetic (no real one is needed): tokenizer.ggml.model gpt2 with pre-tokenizer \
'default', the 256 GPT-2 byte tokens, 702 merges (' '+letter and letter pairs), filler tokens \
<tN> up to the vocabulary size, and <|begin_of_text|> / <|end_of_text|> as the last two (control) \
tokens. Context lengths are the real ones (llama3.2-1b: 131072); --ctx writes another.\n\n\
Examples:\n  \
quire make-model --preset smollm2-135m --dtype q8_0 /tmp/smol-q8.gguf\n  \
quire bench -m /tmp/smol-q8.gguf -p 64 -n 16\n  \
llama-bench -m /tmp/smol-q8.gguf -p 64 -n 16\n  \
quire make-model --preset llama3-8b --dtype f16 /data/llama3-8b-f16.gguf\n  \
quire make-model --preset qwen3-8b --dtype q4_0 --layers 2 /tmp/qwen3-2l.gguf";

#[derive(Args, Debug)]
#[command(after_long_help = long_help())]
pub struct MakeModelArgs {
    /// Which model's shapes and hyper-parameters
    #[arg(long)]
    pub preset: Preset,
    /// Type of the 2-D weights (norm weights are always f32)
    #[arg(long, default_value = "f16")]
    pub dtype: Dtype,
    /// Output file (refused if it exists, unless --force)
    pub out: PathBuf,
    /// Overwrite OUT if it exists
    #[arg(long)]
    pub force: bool,
    /// Number of layers instead of the preset's (small files for tests)
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub layers: Option<u64>,
    /// context_length to write instead of the preset's
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub ctx: Option<u32>,
    /// Seed of the random weights
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Dtype {
    #[value(name = "f16")]
    F16,
    #[value(name = "bf16")]
    Bf16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
}

impl Dtype {
    const ALL: [Dtype; 4] = [Dtype::F16, Dtype::Bf16, Dtype::Q8_0, Dtype::Q4_0];

    fn ggml(self) -> GgmlType {
        match self {
            Dtype::F16 => GgmlType::F16,
            Dtype::Bf16 => GgmlType::BF16,
            Dtype::Q8_0 => GgmlType::Q8_0,
            Dtype::Q4_0 => GgmlType::Q4_0,
        }
    }

    /// llama.cpp's `llama_ftype` (`general.file_type`).
    fn file_type(self) -> u32 {
        match self {
            Dtype::F16 => 1,
            Dtype::Q4_0 => 2,
            Dtype::Q8_0 => 7,
            Dtype::Bf16 => 32,
        }
    }
}

/// One tensor of the file, in llama.cpp's names and ggml dim order (`dims[0]` is the row length).
#[derive(Debug, Clone)]
struct TensorSpec {
    name: String,
    dims: Vec<u64>,
    /// Norm weights: f32, all 1.0.
    norm: bool,
    /// Random weights stored f32 whatever the file type (the MoE router, as llama.cpp's converter
    /// and quantizer keep `ffn_gate_inp` f32).
    f32: bool,
}

fn tensor_specs(s: &Shape) -> Vec<TensorSpec> {
    let w = |name: String, dims: &[u64]| TensorSpec {
        name,
        dims: dims.to_vec(),
        norm: false,
        f32: false,
    };
    let n = |name: String, len: u64| TensorSpec {
        name,
        dims: vec![len],
        norm: true,
        f32: false,
    };
    let (q, kv) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let mut v = vec![w("token_embd.weight".into(), &[s.hidden, s.vocab])];
    for i in 0..s.layers {
        let b = |t: &str| format!("blk.{i}.{t}.weight");
        v.push(n(b("attn_norm"), s.hidden));
        v.push(w(b("attn_q"), &[s.hidden, q]));
        v.push(w(b("attn_k"), &[s.hidden, kv]));
        v.push(w(b("attn_v"), &[s.hidden, kv]));
        v.push(w(b("attn_output"), &[q, s.hidden]));
        if s.qk_norm {
            v.push(n(b("attn_q_norm"), s.head_dim));
            v.push(n(b("attn_k_norm"), s.head_dim));
        }
        v.push(n(b("ffn_norm"), s.hidden));
        match s.moe {
            // llama.cpp's qwen3moe names and shapes (src/models/qwen3moe.cpp).
            Some((experts, _, ff)) => {
                v.push(TensorSpec {
                    f32: true,
                    ..w(b("ffn_gate_inp"), &[s.hidden, experts])
                });
                v.push(w(b("ffn_gate_exps"), &[s.hidden, ff, experts]));
                v.push(w(b("ffn_down_exps"), &[ff, s.hidden, experts]));
                v.push(w(b("ffn_up_exps"), &[s.hidden, ff, experts]));
            }
            None => {
                v.push(w(b("ffn_gate"), &[s.hidden, s.inter]));
                v.push(w(b("ffn_up"), &[s.hidden, s.inter]));
                v.push(w(b("ffn_down"), &[s.inter, s.hidden]));
            }
        }
    }
    v.push(n("output_norm.weight".into(), s.hidden));
    if !s.tied {
        v.push(w("output.weight".into(), &[s.hidden, s.vocab]));
    }
    v
}

impl TensorSpec {
    fn dtype(&self, d: Dtype) -> GgmlType {
        if self.norm || self.f32 {
            GgmlType::F32
        } else {
            d.ggml()
        }
    }

    fn bytes(&self, d: Dtype) -> u64 {
        let t = self.dtype(d);
        let elems: u64 = self.dims.iter().product();
        elems / t.block_size() as u64 * t.type_size() as u64
    }
}

/// Parameters and tensor bytes of a model.
fn totals(specs: &[TensorSpec], d: Dtype) -> (u64, u64) {
    let params = specs.iter().map(|t| t.dims.iter().product::<u64>()).sum();
    (params, specs.iter().map(|t| t.bytes(d)).sum())
}

fn long_help() -> String {
    format!("{LONG_ABOUT}\n\n{}", size_table())
}

/// The table of approximate file sizes at the end of `--help`.
fn size_table() -> String {
    let mut s = format!(
        "Approximate file sizes (GB = 10^9 bytes):\n  {:<14} {:>7}",
        "preset", "params"
    );
    for d in Dtype::ALL {
        s.push_str(&format!("{:>9}", format!("{d:?}").to_lowercase()));
    }
    for p in Preset::ALL {
        let specs = tensor_specs(&p.shape());
        s.push_str(&format!(
            "\n  {:<14} {:>7}",
            p.cli_name(),
            params_label(totals(&specs, Dtype::F16).0)
        ));
        for d in Dtype::ALL {
            s.push_str(&format!("{:>7.2}GB", totals(&specs, d).1 as f64 / 1e9));
        }
    }
    s
}

/// GPT-2's byte-to-character map: printable Latin-1 bytes stand for themselves, the others take
/// U+0100 onwards in byte order.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100;
    (0u32..256)
        .map(|b| {
            let cp = if printable(b) {
                b
            } else {
                next += 1;
                next - 1
            };
            char::from_u32(cp).unwrap_or('?')
        })
        .collect()
}

/// The synthetic byte-level BPE vocabulary: tokens, token types and merges. Needs a vocabulary of
/// at least 960 (bytes, merges and the two control tokens).
fn tokenizer(vocab: u64) -> (Vec<String>, Vec<i32>, Vec<String>) {
    let bytes = byte_chars();
    let mut tokens: Vec<String> = bytes.iter().map(char::to_string).collect();
    let mut merges = Vec::new();
    let space = bytes[usize::from(b' ')];
    let letters = 'a'..='z';
    for c in letters.clone() {
        merges.push(format!("{space} {c}"));
        tokens.push(format!("{space}{c}"));
    }
    for a in letters.clone() {
        for b in letters.clone() {
            merges.push(format!("{a} {b}"));
            tokens.push(format!("{a}{b}"));
        }
    }
    let n = vocab as usize;
    for i in tokens.len()..n.saturating_sub(2) {
        tokens.push(format!("<t{i}>"));
    }
    tokens.push("<|begin_of_text|>".into());
    tokens.push("<|end_of_text|>".into());
    let mut types = vec![1i32; tokens.len()];
    types[n - 2..].fill(3);
    (tokens, types, merges)
}

fn strings(v: Vec<String>) -> Value {
    Value::Array(v.into_iter().map(Value::String).collect())
}

/// The writer with all metadata and every tensor declared (streamed).
fn build_writer(p: Preset, s: &Shape, d: Dtype, specs: &[TensorSpec]) -> Result<GgufWriter> {
    let mut w = GgufWriter::new();
    let a = s.arch;
    let k = |key: &str| format!("{a}.{key}");
    let (tokens, types, merges) = tokenizer(s.vocab);
    let quantized = matches!(d, Dtype::Q8_0 | Dtype::Q4_0);
    w.add_metadata("general.architecture", a)?
        .add_metadata(
            "general.name",
            format!(
                "{} (random weights, quire make-model --preset {})",
                s.name,
                p.cli_name()
            ),
        )?
        .add_metadata("general.file_type", d.file_type())?;
    if quantized {
        w.add_metadata("general.quantization_version", 2u32)?;
    }
    w.add_metadata(k("context_length"), s.ctx)?
        .add_metadata(k("embedding_length"), s.hidden as u32)?
        .add_metadata(k("block_count"), s.layers as u32)?
        .add_metadata(k("feed_forward_length"), s.inter as u32)?
        .add_metadata(k("attention.head_count"), s.heads as u32)?
        .add_metadata(k("attention.head_count_kv"), s.kv_heads as u32)?
        .add_metadata(k("attention.key_length"), s.head_dim as u32)?
        .add_metadata(k("attention.value_length"), s.head_dim as u32)?
        .add_metadata(k("attention.layer_norm_rms_epsilon"), s.eps)?
        .add_metadata(k("rope.freq_base"), s.rope_theta)?
        .add_metadata(k("rope.dimension_count"), s.head_dim as u32)?
        .add_metadata(k("vocab_size"), s.vocab as u32)?;
    if let Some((experts, used, ff)) = s.moe {
        w.add_metadata(k("expert_count"), experts as u32)?
            .add_metadata(k("expert_used_count"), used as u32)?
            .add_metadata(k("expert_feed_forward_length"), ff as u32)?;
    }
    w.add_metadata("tokenizer.ggml.model", "gpt2")?
        .add_metadata("tokenizer.ggml.pre", "default")?
        .add_metadata("tokenizer.ggml.tokens", strings(tokens))?
        .add_metadata(
            "tokenizer.ggml.token_type",
            Value::Array(types.into_iter().map(Value::I32).collect()),
        )?
        .add_metadata("tokenizer.ggml.merges", strings(merges))?
        .add_metadata("tokenizer.ggml.bos_token_id", (s.vocab - 2) as u32)?
        .add_metadata("tokenizer.ggml.eos_token_id", (s.vocab - 1) as u32)?
        .add_metadata("tokenizer.ggml.add_bos_token", s.add_bos)?
        .add_metadata("tokenizer.ggml.add_eos_token", false)?;
    for t in specs {
        w.add_tensor_streamed(t.name.clone(), &t.dims, t.dtype(d))?;
    }
    Ok(w)
}

/// A random pattern of whole blocks of `t`, about [`PATTERN_BYTES`] long (an odd block count).
fn random_pattern(t: GgmlType, rng: &mut StdRng) -> Result<Vec<u8>> {
    let blocks = (PATTERN_BYTES / t.type_size()) | 1;
    let normal = Normal::new(0.0f32, WEIGHT_STD).context("weight distribution")?;
    let values: Vec<f32> = (0..blocks * t.block_size())
        .map(|_| normal.sample(rng))
        .collect();
    let mut bytes = Vec::with_capacity(blocks * t.type_size());
    quantize_row(t, &values, &mut bytes)?;
    Ok(bytes)
}

/// Writes `n` bytes of `pattern` repeated, starting at byte `start` of it.
fn write_repeated(
    out: &mut dyn Write,
    pattern: &[u8],
    mut start: usize,
    mut n: u64,
    bar: &ProgressBar,
) -> io::Result<()> {
    while n > 0 {
        let len = (pattern.len() - start).min(usize::try_from(n).unwrap_or(usize::MAX));
        out.write_all(&pattern[start..start + len])?;
        bar.inc(len as u64);
        n -= len as u64;
        start = 0;
    }
    Ok(())
}

/// Creates `path`: refuses an existing file unless `force`.
fn create(path: &Path, force: bool) -> Result<File> {
    let mut o = OpenOptions::new();
    o.write(true);
    if force {
        o.create(true).truncate(true);
    } else {
        o.create_new(true);
    }
    o.open(path).map_err(|e| {
        if e.kind() == ErrorKind::AlreadyExists {
            anyhow!(
                "{} already exists; pass --force to overwrite it",
                path.display()
            )
        } else {
            anyhow::Error::new(e).context(format!("cannot create {}", path.display()))
        }
    })
}

/// Parameters as model names give them: 8.03B, 135M.
fn params_label(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.2}B", n as f64 / 1e9)
    } else {
        format!("{:.0}M", n as f64 / 1e6)
    }
}

fn gb(bytes: u64) -> String {
    format!("{:.2} GB", bytes as f64 / 1e9)
}

pub fn run(a: MakeModelArgs) -> Result<()> {
    let mut shape = a.preset.shape();
    if let Some(l) = a.layers {
        shape.layers = l;
    }
    if let Some(c) = a.ctx {
        shape.ctx = c;
    }
    let specs = tensor_specs(&shape);
    let writer = build_writer(a.preset, &shape, a.dtype, &specs)?;
    let size = writer.file_size()?;
    let (params, data) = totals(&specs, a.dtype);

    let t0 = Instant::now();
    let mut rng = StdRng::seed_from_u64(a.seed);
    let weights = random_pattern(a.dtype.ggml(), &mut rng)?;
    let ones: Vec<u8> = [1.0f32; 1024]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let f32_weights = random_pattern(GgmlType::F32, &mut rng)?;
    let starts: Vec<usize> = specs
        .iter()
        .map(|t| {
            let (p, block) = if t.f32 {
                (&f32_weights, 4)
            } else {
                (&weights, a.dtype.ggml().type_size())
            };
            rng.random_range(0..p.len() / block) * block
        })
        .collect();

    let file = create(&a.out, a.force)?;
    // Only a regular file is removed after a failure (never, say, a device given with --force).
    let regular = file.metadata().map(|m| m.is_file()).unwrap_or(false);
    eprintln!(
        "writing {}: {} {} ({} layer{}, {} parameters, {} tensors), {}",
        a.out.display(),
        shape.name,
        format!("{:?}", a.dtype).to_lowercase(),
        shape.layers,
        if shape.layers == 1 { "" } else { "s" },
        params_label(params),
        specs.len(),
        gb(size)
    );
    let bar = ProgressBar::new(data);
    if let Ok(style) = ProgressStyle::with_template(
        "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style);
    }
    let mut next = 0usize;
    let result = (|| -> Result<File> {
        let mut w = BufWriter::with_capacity(BUFFER_BYTES, file);
        writer
            .write_to_with(&mut w, |info, out| {
                let i = next;
                next += 1;
                let (pattern, start) = match specs.get(i) {
                    Some(t) if t.norm => (&ones, 0),
                    Some(t) if t.f32 => (&f32_weights, starts[i]),
                    Some(_) => (&weights, starts[i]),
                    None => return Err(io::Error::other("more tensors than declared")),
                };
                write_repeated(out, pattern, start, info.size_bytes(), &bar)
            })
            .map_err(|e| match e {
                // The I/O error itself: the path is added below, and GgufError's message would
                // repeat the cause.
                GgufError::Write(io) => anyhow::Error::new(io),
                e => e.into(),
            })?;
        // No fsync: the file is read right away (from the page cache), and syncing 16 GB would
        // time the disk rather than this command.
        Ok(w.into_inner().map_err(|e| e.into_error())?)
    })();
    match result {
        Ok(_) => {
            bar.finish_and_clear();
            let s = t0.elapsed().as_secs_f64();
            eprintln!(
                "wrote {}: {} in {s:.1} s ({:.2} GB/s)",
                a.out.display(),
                gb(size),
                size as f64 / 1e9 / s
            );
            Ok(())
        }
        Err(e) => {
            bar.abandon();
            let removed = regular && std::fs::remove_file(&a.out).is_ok();
            Err(e.context(format!(
                "cannot write {}{}",
                a.out.display(),
                if removed {
                    " (partial file removed)"
                } else {
                    ""
                }
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_sizes_match_the_real_models() {
        let params = |p: Preset| totals(&tensor_specs(&p.shape()), Dtype::F16).0;
        // Published parameter counts: 8.03B, 1.24B, 134.5M, 8.19B.
        assert_eq!(params(Preset::Llama3_8b), 8_030_261_248);
        assert_eq!(params(Preset::Llama3_70b), 70_553_706_496);
        assert_eq!(params(Preset::Llama32_1b), 1_235_814_400);
        assert_eq!(params(Preset::Smollm2_135m), 134_515_008);
        assert_eq!(params(Preset::Qwen3_8b), 8_190_735_360);
        // Qwen3-30B-A3B "30.5B": 48 x (18.87M attn + 0.26M router + 603.98M experts) + 622.33M.
        assert_eq!(params(Preset::Qwen3_30bA3b), 30_532_122_624);
        let smol = tensor_specs(&Preset::Smollm2_135m.shape());
        // 134_479_872 matrix weights in 34-byte blocks of 32, 35_136 f32 norm weights.
        assert_eq!(totals(&smol, Dtype::Q8_0).1, 143_025_408);
        assert_eq!(totals(&smol, Dtype::Q4_0).1, 75_785_472);
    }

    /// The tiny MoE preset loads through quire's GGUF loader with llama.cpp's names and keys, and
    /// its CPU forward pass agrees between a grouped prefill and token-by-token decoding.
    #[test]
    fn moe_preset_loads_and_prefill_matches_decode() {
        use quire_backend::cpu::{CpuExecutor, CpuOptions};
        use quire_backend::{Executor, ForwardBatch, KvCacheSpec, SeqBatch};
        let dir = std::env::temp_dir().join(format!("quire-moe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tiny.gguf");
        run(MakeModelArgs {
            preset: Preset::Qwen3MoeTiny,
            dtype: Dtype::Q8_0,
            out: path.clone(),
            force: true,
            layers: Some(3),
            ctx: None,
            seed: 5,
        })
        .unwrap();
        let model = quire_model::load_gguf(&path).unwrap();
        let c = &model.weights.config;
        assert_eq!(c.arch, quire_core::Architecture::Qwen3Moe);
        assert_eq!(c.num_layers, 3);
        assert_eq!(
            c.moe,
            Some(quire_core::MoeConfig {
                num_experts: 8,
                num_experts_per_tok: 2,
                expert_intermediate_size: 64,
                norm_topk_prob: true,
            })
        );
        let kv = KvCacheSpec {
            num_blocks: 4,
            block_size: 16,
        };
        let opts = CpuOptions {
            threads: 2,
            ..Default::default()
        };
        let (tokens, n): (Vec<u32>, _) = ((0..11).map(|i| (i * 97 + 5) % 1024).collect(), 11);
        let table = [quire_core::BlockId(0), quire_core::BlockId(1)];
        let positions: Vec<u32> = (0..n as u32).collect();
        // One prefill of all tokens, logits of every row.
        let mut a = CpuExecutor::new(&model.weights, kv, opts).unwrap();
        let all: Vec<u32> = (0..n as u32).collect();
        let seqs = [SeqBatch {
            query_start: 0,
            query_len: n,
            seq_len: n,
            block_table: &table,
        }];
        let prefill = a
            .forward(&ForwardBatch {
                token_ids: &tokens,
                positions: &positions,
                slot_mapping: &positions,
                seqs: &seqs,
                logits_indices: &all,
            })
            .unwrap()
            .to_vec();
        assert!(prefill.iter().all(|v| v.is_finite()));
        // The same tokens one at a time.
        let mut b = CpuExecutor::new(&model.weights, kv, opts).unwrap();
        let vocab = c.vocab_size;
        let mut worst = 0f32;
        for t in 0..n {
            let seqs = [SeqBatch {
                query_start: 0,
                query_len: 1,
                seq_len: t + 1,
                block_table: &table,
            }];
            let got = b
                .forward(&ForwardBatch {
                    token_ids: &tokens[t..t + 1],
                    positions: &positions[t..t + 1],
                    slot_mapping: &positions[t..t + 1],
                    seqs: &seqs,
                    logits_indices: &[0],
                })
                .unwrap();
            let want = &prefill[t * vocab..(t + 1) * vocab];
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let err = got
                .iter()
                .zip(want)
                .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
            worst = worst.max(err / scale);
        }
        assert!(worst < 1e-3, "prefill vs decode rel err {worst:.2e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn tokenizer_tokens_are_distinct_and_merges_resolve() {
        let (tokens, types, merges) = tokenizer(49152);
        assert_eq!((tokens.len(), types.len()), (49152, 49152));
        let set: std::collections::HashSet<_> = tokens.iter().collect();
        assert_eq!(set.len(), tokens.len());
        assert_eq!(tokens[usize::from(b'A')], "A");
        assert_eq!(tokens[usize::from(b' ')], "\u{120}");
        assert_eq!(tokens[usize::from(b'\n')], "\u{10a}");
        for m in &merges {
            let (l, r) = m.split_once(' ').unwrap();
            assert!(set.contains(&l.to_string()) && set.contains(&format!("{l}{r}")));
        }
        assert_eq!(&types[49150..], &[3, 3]);
        assert!(types[..49150].iter().all(|&t| t == 1));
    }

    #[test]
    fn patterns_are_whole_blocks_of_small_finite_values() {
        let mut rng = StdRng::seed_from_u64(3);
        for d in Dtype::ALL {
            let t = d.ggml();
            let p = random_pattern(t, &mut rng).unwrap();
            assert_eq!(p.len() % t.type_size(), 0);
            let n = p.len() / t.type_size() * t.block_size();
            let mut v = vec![0f32; n];
            quire_gguf::dequantize_row(t, &p, &mut v).unwrap();
            let rms = (v.iter().map(|x| x * x).sum::<f32>() / n as f32).sqrt();
            assert!(v.iter().all(|x| x.is_finite()), "{d:?}");
            assert!((0.015..0.025).contains(&rms), "{d:?} rms {rms}");
        }
    }
}
