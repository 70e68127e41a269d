//! Deterministic HF model folders without torch: the portable weight generator of
//! tests/hf/make_models.py (splitmix64 keyed by FNV-1a of the tensor name) and a safetensors writer
//! (one file, or shards with an index). The transformers parity tests rebuild the exact weights
//! transformers ran with from a fixture's `manifest.json`; other tests build tiny models from a
//! [`ModelConfig`]. Keep `gen_values` in step with the Python script.

use std::collections::HashMap;
use std::path::Path;

use quire_core::ModelConfig;
pub use safetensors::Dtype;
use serde::{Deserialize, Serialize};

use crate::ModelError;

pub const SEED: u64 = 0x5155495245; // "QUIRE"
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// One splitmix64 output for state `z` (the state advance included).
pub fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

pub fn fnv1a64(s: &str) -> u64 {
    let mut h: u64 = 0xCBF2_9CE4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01B3);
    }
    h
}

/// Element `i` of tensor `name` (row-major), in f64: `offset + scale * (2u - 1)` with `u` the top
/// 24 bits of `splitmix64(key + i)` over 2^24, `key = splitmix64(SEED ^ fnv1a64(name))`.
pub fn gen_values_f64(name: &str, n: usize, offset: f64, scale: f64) -> Vec<f64> {
    let key = splitmix64(SEED ^ fnv1a64(name));
    (0..n as u64)
        .map(|i| {
            let u = (splitmix64(key.wrapping_add(i)) >> 40) as f64 / 16_777_216.0;
            offset + scale * (2.0 * u - 1.0)
        })
        .collect()
}

/// The values rounded once to f32, as the script stores them.
pub fn gen_values(name: &str, n: usize, offset: f64, scale: f64) -> Vec<f32> {
    gen_values_f64(name, n, offset, scale)
        .into_iter()
        .map(|v| v as f32)
        .collect()
}

/// `(offset, scale)` of a tensor by its role (the script's `gen_params`).
pub fn gen_params(name: &str) -> (f64, f64) {
    if name.ends_with("norm.weight") {
        (1.0, 0.25)
    } else if name.ends_with(".bias") {
        (0.0, 0.125)
    } else if name.ends_with("embed_tokens.weight") {
        (0.0, 1.0)
    } else {
        (0.0, 0.25)
    }
}

/// One tensor of a fixture's `manifest.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ManifestTensor {
    pub name: String,
    /// HF (PyTorch) order.
    pub shape: Vec<usize>,
    pub dtype: String,
    pub offset: f64,
    pub scale: f64,
}

impl ManifestTensor {
    pub fn new(name: String, shape: Vec<usize>) -> Self {
        let (offset, scale) = gen_params(&name);
        Self {
            name,
            shape,
            dtype: "F32".into(),
            offset,
            scale,
        }
    }

    pub fn values(&self) -> Vec<f32> {
        gen_values(
            &self.name,
            self.shape.iter().product(),
            self.offset,
            self.scale,
        )
    }
}

#[derive(Deserialize)]
struct Manifest {
    seed: u64,
    tensors: Vec<ManifestTensor>,
}

pub fn read_manifest(path: &Path) -> Result<Vec<ManifestTensor>, ModelError> {
    let err = |msg: String| ModelError::Io {
        path: path.display().to_string(),
        msg,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let m: Manifest = serde_json::from_str(&text).map_err(|e| err(format!("bad manifest: {e}")))?;
    if m.seed != SEED {
        return Err(err(format!(
            "seed {:#x}, this generator uses {SEED:#x}",
            m.seed
        )));
    }
    Ok(m.tensors)
}

/// The tensors transformers saves for `c` (HF names and shapes; Qwen3-MoE experts per expert).
pub fn manifest_for(c: &ModelConfig) -> Vec<ManifestTensor> {
    let (hd, qs, kvs, inter) = (c.hidden_size, c.q_size(), c.kv_size(), c.intermediate_size);
    let mut t = vec![
        ManifestTensor::new("model.embed_tokens.weight".into(), vec![c.vocab_size, hd]),
        ManifestTensor::new("model.norm.weight".into(), vec![hd]),
    ];
    if !c.tie_word_embeddings {
        t.push(ManifestTensor::new(
            "lm_head.weight".into(),
            vec![c.vocab_size, hd],
        ));
    }
    for i in 0..c.num_layers {
        let mut add = |s: &str, shape: Vec<usize>| {
            t.push(ManifestTensor::new(format!("model.layers.{i}.{s}"), shape))
        };
        add("input_layernorm.weight", vec![hd]);
        add("post_attention_layernorm.weight", vec![hd]);
        add("self_attn.q_proj.weight", vec![qs, hd]);
        add("self_attn.k_proj.weight", vec![kvs, hd]);
        add("self_attn.v_proj.weight", vec![kvs, hd]);
        add("self_attn.o_proj.weight", vec![hd, qs]);
        if c.attention_bias {
            add("self_attn.q_proj.bias", vec![qs]);
            add("self_attn.k_proj.bias", vec![kvs]);
            add("self_attn.v_proj.bias", vec![kvs]);
        }
        if c.qk_norm {
            add("self_attn.q_norm.weight", vec![c.head_dim]);
            add("self_attn.k_norm.weight", vec![c.head_dim]);
        }
        match &c.moe {
            // Qwen3-MoE as checkpoints store it: a router and one tensor per expert.
            Some(m) => {
                let mi = m.expert_intermediate_size;
                add("mlp.gate.weight", vec![m.num_experts, hd]);
                for e in 0..m.num_experts {
                    add(&format!("mlp.experts.{e}.gate_proj.weight"), vec![mi, hd]);
                    add(&format!("mlp.experts.{e}.up_proj.weight"), vec![mi, hd]);
                    add(&format!("mlp.experts.{e}.down_proj.weight"), vec![hd, mi]);
                }
            }
            None => {
                add("mlp.gate_proj.weight", vec![inter, hd]);
                add("mlp.up_proj.weight", vec![inter, hd]);
                add("mlp.down_proj.weight", vec![hd, inter]);
            }
        }
    }
    t
}

/// Stored bytes of f32 values in `dtype` (F32, F16 or BF16).
pub fn encode(values: &[f32], dtype: Dtype) -> Result<Vec<u8>, ModelError> {
    Ok(match dtype {
        Dtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::F16 => values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        Dtype::BF16 => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        other => return Err(ModelError::Invalid(format!("cannot write {other:?}"))),
    })
}

fn io(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Io {
        path: path.display().to_string(),
        msg: e.to_string(),
    }
}

/// Writes one safetensors file from (name, dtype, HF shape, bytes).
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
) -> Result<(), ModelError> {
    let views = tensors
        .iter()
        .map(|(n, d, s, b)| {
            safetensors::tensor::TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| io(path, e))
        })
        .collect::<Result<Vec<_>, _>>()?;
    safetensors::serialize_to_file(views, None, path).map_err(|e| io(path, e))
}

/// Writes the generator's weights of `tensors` into `dir` as `dtype`: `model.safetensors`, or
/// `shards` files `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`.
pub fn write_weights(
    dir: &Path,
    tensors: &[ManifestTensor],
    dtype: Dtype,
    shards: usize,
) -> Result<(), ModelError> {
    let shards = shards.max(1);
    let encoded = tensors
        .iter()
        .map(|t| {
            Ok((
                t.name.clone(),
                dtype,
                t.shape.clone(),
                encode(&t.values(), dtype)?,
            ))
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    if shards == 1 {
        return write_safetensors(&dir.join("model.safetensors"), &encoded);
    }
    let per = encoded.len().div_ceil(shards);
    let mut weight_map = HashMap::new();
    for (i, chunk) in encoded.chunks(per).enumerate() {
        let name = format!("model-{:05}-of-{shards:05}.safetensors", i + 1);
        for t in chunk {
            weight_map.insert(t.0.clone(), name.clone());
        }
        write_safetensors(&dir.join(&name), chunk)?;
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    let path = dir.join("model.safetensors.index.json");
    std::fs::write(&path, index.to_string()).map_err(|e| io(&path, e))
}

/// A runnable HF folder in `out` from a fixture directory (tests/hf/fixtures/ARCH): its
/// `config.json`, tokenizer and generation files copied, the weights regenerated from
/// `manifest.json` as `dtype` (`shards` files when more than one). For trying `quire info` and
/// `quire generate -m` on an architecture without torch.
pub fn write_fixture_folder(
    fixture: &Path,
    out: &Path,
    dtype: Dtype,
    shards: usize,
) -> Result<(), ModelError> {
    let tensors = read_manifest(&fixture.join("manifest.json"))?;
    std::fs::create_dir_all(out).map_err(|e| io(out, e))?;
    for f in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        let src = fixture.join(f);
        if src.exists() {
            std::fs::copy(&src, out.join(f)).map_err(|e| io(&src, e))?;
        }
    }
    write_weights(out, &tensors, dtype, shards)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generator_equals_the_python_script() {
        // `python3 tests/hf/make_models.py --out x --self-test` prints these.
        let a = gen_values_f64("model.norm.weight", 4, 1.0, 0.25);
        let b = gen_values_f64("lm_head.weight", 4, 0.0, 0.25);
        assert_eq!(
            a,
            [
                0.8566209375858307,
                1.0636591017246246,
                1.094665139913559,
                1.0697879791259766
            ]
        );
        assert_eq!(
            b,
            [
                -0.24978306889533997,
                0.17716816067695618,
                0.008884251117706299,
                0.18712535500526428
            ]
        );
    }
}
