//! Random test inputs shared by the kernel tests of every backend: uniform values, and weight
//! tensors of any GGUF type made from them (quantized by the gguf crate's reference quantizer).

use half::f16;
use quire_backend::{HostTensor, TensorBytes};
use quire_gguf::GgmlType;
use rand::rngs::StdRng;
use rand::Rng;

/// `n` values drawn uniformly from (-a, a).
pub fn rnd(rng: &mut StdRng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-a..a)).collect()
}

/// A `[rows, cols]` tensor of type `t` (ggml dims `[cols, rows]`) from random values in [-1, 1].
pub fn tensor(rng: &mut StdRng, t: GgmlType, rows: usize, cols: usize) -> HostTensor {
    let v = rnd(rng, rows * cols, 1.0);
    let mut bytes = Vec::new();
    match t {
        GgmlType::F32 => bytes.extend(v.iter().flat_map(|x| x.to_le_bytes())),
        GgmlType::F16 => bytes.extend(v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes())),
        GgmlType::BF16 => bytes.extend(
            v.iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()),
        ),
        _ => quire_gguf::quantize_row(t, &v, &mut bytes).expect("quantizes"),
    }
    HostTensor {
        name: format!("w_{}_{rows}x{cols}", t.name()),
        dtype: t,
        dims: vec![cols, rows],
        bytes: TensorBytes::owned(bytes),
    }
}
