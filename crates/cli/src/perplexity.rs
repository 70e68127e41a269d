//! `quire perplexity`: llama.cpp's method. The whole file is tokenized (no BOS), cut into chunks
//! of `ctx` tokens (the remainder dropped); each chunk runs from an empty cache and only the second
//! half is scored: the NLL of tokens `ctx/2 + 1 .. ctx` given everything before them in the chunk.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use quire_backend::KvCacheSpec;
use quire_engine::runner::forward_single;
use quire_engine::sampler::log_sum_exp;
use serde_json::json;

use crate::common::{executor, load_model, ModelArgs};

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file to score
    #[arg(long, short = 'f')]
    pub file: PathBuf,
    /// Tokens per chunk
    #[arg(long, short = 'c', default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many chunks (all by default)
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Print {"ppl": …, "chunks": …} on the last line
    #[arg(long)]
    pub json: bool,
    /// KV-cache storage type: f16 (the default, llama.cpp's numerics) or f32 (exact f32 attention)
    #[arg(long, default_value = "f16", value_parser = ["f32", "f16"])]
    pub kv_dtype: String,
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    if a.ctx < 4 {
        bail!("--ctx must be at least 4");
    }
    let model = load_model(&a.model)?;
    let text =
        std::fs::read(&a.file).with_context(|| format!("cannot read {}", a.file.display()))?;
    let text = String::from_utf8_lossy(&text);
    let tokens = model.tokenizer.encode(&text, false, false)?;
    let mut n_chunks = tokens.len() / a.ctx;
    if let Some(c) = a.chunks {
        n_chunks = n_chunks.min(c);
    }
    if n_chunks == 0 {
        bail!(
            "{} has {} tokens, fewer than one chunk of {}",
            a.file.display(),
            tokens.len(),
            a.ctx
        );
    }
    let block_size = 16;
    let kv = KvCacheSpec {
        num_blocks: a.ctx.div_ceil(block_size),
        block_size,
    };
    let mut exec = executor(&model, &a.model, kv, &a.kv_dtype)?;
    let vocab = exec.vocab_size();
    let first = a.ctx / 2;
    let rows: Vec<u32> = (first as u32..a.ctx as u32 - 1).collect();
    let bar = indicatif::ProgressBar::new(n_chunks as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} chunks  ppl {msg}  eta {eta}",
        )
        .expect("static template"),
    );
    let mut nll = 0f64;
    let mut count = 0usize;
    let mut per_chunk = Vec::new();
    let t0 = std::time::Instant::now();
    for c in 0..n_chunks {
        let chunk: Vec<u32> = tokens[c * a.ctx..(c + 1) * a.ctx]
            .iter()
            .map(|t| t.0)
            .collect();
        let logits = forward_single(exec.as_mut(), &chunk, &rows)?;
        for (i, &row) in rows.iter().enumerate() {
            let l = &logits[i * vocab..(i + 1) * vocab];
            let target = chunk[row as usize + 1] as usize;
            nll += (log_sum_exp(l) - l[target]) as f64;
            count += 1;
        }
        let ppl = (nll / count as f64).exp();
        per_chunk.push(ppl);
        bar.set_message(format!("{ppl:.4}"));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let ppl = (nll / count as f64).exp();
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "{} tokens in {n_chunks} chunks of {}, {count} scored, {:.1} s ({:.1} tok/s)",
        tokens.len(),
        a.ctx,
        secs,
        (n_chunks * a.ctx) as f64 / secs
    );
    if a.json {
        println!(
            "{}",
            json!({"ppl": ppl, "chunks": n_chunks, "ctx": a.ctx, "scored_tokens": count, "per_chunk_ppl": per_chunk})
        );
    } else {
        println!("PPL = {ppl:.4} over {n_chunks} chunks");
    }
    Ok(())
}
