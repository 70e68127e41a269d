//! `quire info`: a GGUF file's metadata and tensor table, as text or JSON.

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
