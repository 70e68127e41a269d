//! `quire info`: a GGUF file's metadata and tensor table, or an HF folder's config.json, derived
//! config and tensor table, as text or JSON.

use anyhow::{Context, Result};
use clap::Args;
use quire_gguf::{GgufFile, Value};
use serde_json::json;

use crate::common::ModelArgs;

#[derive(Args, Debug)]
pub struct InfoArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Print JSON instead of tables
    #[arg(long)]
    pub json: bool,
    /// Show arrays whole instead of their first items
    #[arg(long)]
    pub full: bool,
}

fn value_json(v: &Value, full: bool) -> serde_json::Value {
    match v {
        Value::Array(items) => {
            let n = if full {
                items.len()
            } else {
                items.len().min(16)
            };
            let shown: Vec<_> = items[..n].iter().map(|x| value_json(x, full)).collect();
            if n < items.len() {
                json!({"type": "array", "len": items.len(), "head": shown})
            } else {
                serde_json::Value::Array(shown)
            }
        }
        Value::String(s) => json!(s),
        Value::Bool(b) => json!(b),
        Value::F32(x) => json!(x),
        Value::F64(x) => json!(x),
        other => match other.as_i64() {
            Some(i) => json!(i),
            None => json!(other.as_u64()),
        },
    }
}

fn value_text(v: &Value, full: bool) -> String {
    match v {
        Value::Array(items) => {
            let n = if full {
                items.len()
            } else {
                items.len().min(8)
            };
            let parts: Vec<String> = items[..n].iter().map(|x| value_text(x, full)).collect();
            let more = if n < items.len() {
                format!(", … ({} items)", items.len())
            } else {
                String::new()
            };
            format!("[{}{more}]", parts.join(", "))
        }
        Value::String(s) if !full && s.chars().count() > 120 => {
            format!(
                "{:?}… ({} chars)",
                s.chars().take(120).collect::<String>(),
                s.chars().count()
            )
        }
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

pub fn run(a: InfoArgs) -> Result<()> {
    let path =
        quire_model::resolve_model_path(a.model.model.as_deref(), &mut |m| eprintln!("{m}"))?;
    if path.is_dir() {
        return hf_info(&path, a.json);
    }
    let f = GgufFile::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
    if a.json {
        let meta: serde_json::Map<String, serde_json::Value> = f
            .metadata()
            .iter()
            .map(|(k, v)| (k.clone(), value_json(v, a.full)))
            .collect();
        let tensors: Vec<_> = f
            .tensors()
            .iter()
            .map(|t| json!({"name": t.name, "type": t.dtype.name(), "dims": t.dims, "offset": t.offset, "bytes": t.size_bytes()}))
            .collect();
        let j = json!({
            "path": path.display().to_string(),
            "version": f.version(),
            "alignment": f.alignment(),
            "metadata": meta,
            "tensors": tensors,
        });
        println!("{j}");
        return Ok(());
    }
    println!(
        "{}: GGUF v{}, {} metadata keys, {} tensors, alignment {}",
        path.display(),
        f.version(),
        f.metadata().len(),
        f.tensors().len(),
        f.alignment()
    );
    println!();
    for (k, v) in f.metadata() {
        println!("{k:<45} {:<8} {}", v.type_name(), value_text(v, a.full));
    }
    println!();
    println!(
        "{:<36} {:<6} {:>22} {:>12} {:>12}",
        "tensor", "type", "dims", "offset", "bytes"
    );
    let mut total = 0u64;
    for t in f.tensors() {
        total += t.size_bytes();
        println!(
            "{:<36} {:<6} {:>22} {:>12} {:>12}",
            t.name,
            t.dtype.name(),
            format!("{:?}", t.dims),
            t.offset,
            t.size_bytes()
        );
    }
    let n: u64 = f.tensors().iter().map(|t| t.n_elements()).sum();
    println!(
        "\n{} parameters, {:.2} MiB of tensor data",
        n,
        total as f64 / (1 << 20) as f64
    );
    Ok(())
}

/// An HF model folder: config.json as written, the config quire derives from it (or why it cannot),
/// and the tensors of all shards.
fn hf_info(dir: &std::path::Path, as_json: bool) -> Result<()> {
    let info =
        quire_model::hf::inspect(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    let derived = match &info.config {
        Ok(c) => json!({"config": c.config, "rope_freqs": c.rope_freqs, "dtype": c.dtype}),
        Err(e) => json!({"error": e.to_string()}),
    };
    if as_json {
        let tensors: Vec<_> = info
            .tensors
            .iter()
            .map(|(n, t, s, f)| json!({"name": n, "type": t, "shape": s, "file": f}))
            .collect();
        let j = json!({
            "path": dir.display().to_string(),
            "format": "hf",
            "config_json": info.config_json,
            "quire_config": derived,
            "tensors": tensors,
            "bytes": info.total_bytes,
        });
        println!("{j}");
        return Ok(());
    }
    println!(
        "{}: HF model folder, {} tensors, {:.2} MiB of safetensors",
        dir.display(),
        info.tensors.len(),
        info.total_bytes as f64 / (1 << 20) as f64
    );
    println!("\nconfig.json:");
    if let Some(o) = info.config_json.as_object() {
        for (k, v) in o {
            println!("  {k:<40} {v}");
        }
    }
    println!("\nas quire runs it:");
    match &info.config {
        Ok(c) => {
            if let Some(o) = serde_json::to_value(&c.config)?.as_object() {
                for (k, v) in o {
                    println!("  {k:<40} {v}");
                }
            }
            if let Some(r) = &c.rope_freqs {
                println!("  {:<40} {r:?}", "rope frequency divisors");
            }
        }
        Err(e) => println!("  not runnable: {e}"),
    }
    println!();
    println!("{:<52} {:<5} {:>16}  file", "tensor", "type", "shape");
    let mut n = 0u64;
    for (name, t, shape, file) in &info.tensors {
        n += shape.iter().product::<usize>() as u64;
        println!("{name:<52} {t:<5} {:>16}  {file}", format!("{shape:?}"));
    }
    println!("\n{n} parameters");
    Ok(())
}
