//! `quire quantize`: rewrites a GGUF model with its weight matrices in another type (K-quants,
//! Q8_0/Q4_0/Q4_1, f16), so that one source file gives every format quire runs, and the
//! perplexity cost of a format can be measured against its f16 source.
//!
//! Metadata is copied (with `general.file_type` updated); tensors with fewer than two dimensions
//! (norm weights, biases) are copied byte for byte; every matrix is dequantized row by row from
//! its stored type and quantized to the target. A K-quant needs rows that are a multiple of 256;
//! a matrix whose rows are not (all of SmolLM2-135M's 576-wide ones) is written in a fallback
//! type instead, as llama.cpp's quantizer does, and the command lists them. The output is
//! streamed: rows are converted in parallel in chunks and written in order, never the whole file
//! in memory.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use quire_gguf::{
    dequantize_row, quantize_row, GgmlType, GgufError, GgufFile, GgufWriter, TensorInfo,
};
use rayon::prelude::*;

/// Rows converted per parallel chunk (bounded memory, enough work per thread).
const CHUNK_ROWS: usize = 256;
/// Write buffer: large writes reach the OS in few system calls.
const BUFFER_BYTES: usize = 16 << 20;

const LONG_ABOUT: &str = "Rewrites a GGUF model with every weight matrix in TYPE. Metadata is \
copied (general.file_type updated); 1-D tensors (norm weights, biases) are copied unchanged \
(F32 stays F32); matrices are dequantized from their stored type (any type quire reads: f32, f16, \
bf16, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k) and quantized to TYPE.\n\n\
K-quants (q4_k, q5_k, q6_k) pack 256 elements per block, so they need rows whose length is a \
multiple of 256. A matrix whose rows are not is written in the fallback type instead (llama.cpp \
does the same, with q5_0/q5_1/q8_0 for q4_k/q5_k/q6_k; quire has no q5_0/q5_1 and uses q8_0 \
unless --fallback says otherwise); the command lists those tensors. SmolLM2-135M's rows are 576 \
wide, so only its ffn_down matrices (rows of 1536) take a K-quant; Llama 3 shapes take them \
everywhere.\n\n\
The K-quant quantizer is quire's own (per sub-block least-squares search of scale and min, no \
importance matrix): same format as llama.cpp's, not the same bytes.\n\n\
Examples:\n  \
quire quantize model-q4_1.gguf /tmp/model-f16.gguf --type f16\n  \
quire quantize /tmp/model-f16.gguf /tmp/model-q4_k.gguf --type q4_k\n  \
quire quantize /tmp/model-f16.gguf /tmp/model-q5_k.gguf --type q5_k --fallback q4_1\n  \
quire perplexity -m /tmp/model-q4_k.gguf --file text.txt";

#[derive(Args, Debug)]
#[command(after_long_help = LONG_ABOUT)]
pub struct QuantizeArgs {
    /// Input GGUF model
    pub input: PathBuf,
    /// Output file (refused if it exists, unless --force)
    pub output: PathBuf,
    /// Type of the weight matrices in the output
    #[arg(long = "type", value_name = "TYPE")]
    pub dtype: QuantType,
    /// Type of matrices whose rows do not fit TYPE's blocks [default: q8_0]
    #[arg(long, value_name = "TYPE")]
    pub fallback: Option<QuantType>,
    /// Overwrite OUTPUT if it exists
    #[arg(long)]
    pub force: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum QuantType {
    #[value(name = "q4_k")]
    Q4K,
    #[value(name = "q5_k")]
    Q5K,
    #[value(name = "q6_k")]
    Q6K,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
    #[value(name = "q4_1")]
    Q4_1,
    #[value(name = "f16")]
    F16,
    #[value(name = "bf16")]
    Bf16,
    #[value(name = "f32")]
    F32,
}

impl QuantType {
    fn ggml(self) -> GgmlType {
        match self {
            QuantType::Q4K => GgmlType::Q4_K,
            QuantType::Q5K => GgmlType::Q5_K,
            QuantType::Q6K => GgmlType::Q6_K,
            QuantType::Q8_0 => GgmlType::Q8_0,
            QuantType::Q4_0 => GgmlType::Q4_0,
            QuantType::Q4_1 => GgmlType::Q4_1,
            QuantType::F16 => GgmlType::F16,
            QuantType::Bf16 => GgmlType::BF16,
            QuantType::F32 => GgmlType::F32,
        }
    }

    /// llama.cpp's `llama_ftype` (`general.file_type`); K-quants as their "_S" (single type)
    /// variants.
    fn file_type(self) -> u32 {
        match self {
            QuantType::F32 => 0,
            QuantType::F16 => 1,
            QuantType::Q4_0 => 2,
            QuantType::Q4_1 => 3,
            QuantType::Q8_0 => 7,
            QuantType::Q4K => 14,
            QuantType::Q5K => 16,
            QuantType::Q6K => 18,
            QuantType::Bf16 => 32,
        }
    }
}

/// What happens to one tensor.
#[derive(Debug, Clone)]
struct Plan {
    info: TensorInfo,
    /// `None`: copied unchanged.
    to: Option<GgmlType>,
}

/// The output type of a matrix with rows of `row_len`: TYPE, else the fallback, else f16 (which
/// fits any row), as llama.cpp picks.
fn pick(row_len: u64, want: GgmlType, fallback: GgmlType) -> GgmlType {
    [want, fallback]
        .into_iter()
        .find(|t| row_len.is_multiple_of(t.block_size() as u64))
        .unwrap_or(GgmlType::F16)
}

fn plan(f: &GgufFile, want: GgmlType, fallback: GgmlType) -> Result<Vec<Plan>> {
    f.tensors()
        .iter()
        .map(|t| {
            if t.dims.len() < 2 {
                return Ok(Plan {
                    info: t.clone(),
                    to: None,
                });
            }
            if !t.dtype.is_supported() {
                bail!(
                    "tensor {:?} is stored as {}, which quire cannot dequantize (it reads f32, \
                     f16, bf16, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k)",
                    t.name,
                    t.dtype
                );
            }
            Ok(Plan {
                info: t.clone(),
                to: Some(pick(t.row_len(), want, fallback)),
            })
        })
        .collect()
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

/// Writes tensor `p` converted to its target type: chunks of rows in parallel, in order.
// data: [rows, row_len] in p.info.dtype
fn convert(p: &Plan, data: &[u8], out: &mut dyn Write, bar: &ProgressBar) -> io::Result<()> {
    let Some(to) = p.to else {
        out.write_all(data)?;
        bar.inc(data.len() as u64);
        return Ok(());
    };
    let from = p.info.dtype;
    let row_len = p.info.row_len() as usize;
    let in_row = row_len / from.block_size() * from.type_size();
    for chunk in data.chunks(CHUNK_ROWS * in_row) {
        let rows: Vec<Vec<u8>> = chunk
            .par_chunks(in_row)
            .map(|src| -> Result<Vec<u8>, GgufError> {
                let mut x = vec![0f32; row_len];
                dequantize_row(from, src, &mut x)?;
                let mut q = Vec::new();
                quantize_row(to, &x, &mut q)?;
                Ok(q)
            })
            .collect::<Result<_, _>>()
            .map_err(|e| io::Error::other(format!("tensor {:?}: {e}", p.info.name)))?;
        for r in &rows {
            out.write_all(r)?;
            bar.inc(r.len() as u64);
        }
    }
    Ok(())
}

fn size_of(info: &TensorInfo, dtype: GgmlType) -> u64 {
    let n: u64 = info.dims.iter().product();
    n / dtype.block_size() as u64 * dtype.type_size() as u64
}

fn gb(bytes: u64) -> String {
    format!("{:.3} GB", bytes as f64 / 1e9)
}

pub fn run(a: QuantizeArgs) -> Result<()> {
    let want = a.dtype.ggml();
    let fallback = a.fallback.unwrap_or(QuantType::Q8_0).ggml();
    let f =
        GgufFile::open(&a.input).with_context(|| format!("cannot read {}", a.input.display()))?;
    if let (Ok(i), Ok(o)) = (a.input.canonicalize(), a.output.canonicalize()) {
        if i == o {
            bail!("input and output are the same file ({})", i.display());
        }
    }
    let plans = plan(&f, want, fallback)?;

    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        match k.as_str() {
            "general.file_type" | "general.quantization_version" => {}
            _ => {
                w.add_metadata(k.clone(), v.clone())
                    .with_context(|| format!("metadata {k:?}"))?;
            }
        }
    }
    w.add_metadata("general.file_type", a.dtype.file_type())?;
    if plans
        .iter()
        .any(|p| p.to.is_some_and(|t| t.block_size() > 1))
    {
        w.add_metadata("general.quantization_version", 2u32)?;
    }
    for p in &plans {
        let dtype = p.to.unwrap_or(p.info.dtype);
        w.add_tensor_streamed(p.info.name.clone(), &p.info.dims, dtype)?;
    }
    let size = w.file_size()?;
    // Before any report: an existing output is refused before work starts.
    let file = create(&a.output, a.force)?;
    let regular = file.metadata().map(|m| m.is_file()).unwrap_or(false);

    // Tensors per output type, and the matrices that could not take TYPE.
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    let mut fell_back: BTreeMap<(String, u64), Vec<&str>> = BTreeMap::new();
    for p in &plans {
        let t = p.to.unwrap_or(p.info.dtype);
        *counts.entry(t.name().to_owned()).or_default() += 1;
        if p.to.is_some_and(|t| t != want) {
            fell_back
                .entry((t.name().to_owned(), p.info.row_len()))
                .or_default()
                .push(&p.info.name);
        }
    }
    eprintln!(
        "quantizing {} -> {} ({}): {} tensors, {} matrices, {}",
        a.input.display(),
        a.output.display(),
        want,
        plans.len(),
        plans.iter().filter(|p| p.to.is_some()).count(),
        gb(size)
    );
    for ((t, row), names) in &fell_back {
        let shown: Vec<&str> = names.iter().take(4).copied().collect();
        eprintln!(
            "  {} matri{} with rows of {row} (not a multiple of {}) kept in {t}: {}{}",
            names.len(),
            if names.len() == 1 { "x" } else { "ces" },
            want.block_size(),
            shown.join(", "),
            if names.len() > shown.len() {
                ", ..."
            } else {
                ""
            }
        );
    }

    let t0 = Instant::now();
    let total: u64 = plans
        .iter()
        .map(|p| size_of(&p.info, p.to.unwrap_or(p.info.dtype)))
        .sum();
    let bar = ProgressBar::new(total);
    if let Ok(style) = ProgressStyle::with_template(
        "{bar:40} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
    ) {
        bar.set_style(style);
    }
    let mut next = 0usize;
    let result = (|| -> Result<()> {
        let mut out = BufWriter::with_capacity(BUFFER_BYTES, file);
        w.write_to_with(&mut out, |info, sink| {
            let p = plans
                .get(next)
                .filter(|p| p.info.name == info.name)
                .ok_or_else(|| io::Error::other("tensor order changed while writing"))?;
            next += 1;
            let data = f.try_tensor_data(&p.info).map_err(io::Error::other)?;
            convert(p, data, sink, &bar)
        })
        .map_err(|e| match e {
            GgufError::Write(io) => anyhow::Error::new(io),
            e => e.into(),
        })?;
        out.into_inner().map_err(|e| e.into_error())?;
        Ok(())
    })();
    bar.finish_and_clear();
    if let Err(e) = result {
        if regular {
            let _ = std::fs::remove_file(&a.output);
        }
        return Err(e.context(format!("cannot write {}", a.output.display())));
    }
    let counts: Vec<String> = counts.iter().map(|(t, n)| format!("{n} {t}")).collect();
    eprintln!(
        "wrote {}: {} in {:.1} s (tensors: {})",
        a.output.display(),
        gb(size),
        t0.elapsed().as_secs_f64(),
        counts.join(", ")
    );
    Ok(())
}
