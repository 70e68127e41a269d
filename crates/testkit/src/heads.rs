//! Zero attention heads added to a model so that a tensor-parallel group can split it.
//!
//! The default model has 9 query heads over 3 KV heads: no group of 2 or 4 GPUs divides them, so
//! the engine suites could not run sharded on it. [`pad_heads_for`] adds KV heads (up to a multiple
//! of the group) and, for each, the same number of query heads as every real KV head has. Their
//! query, key and value projections (and biases) are zero and their columns of the output
//! projection are zero, so a padded head's attention output is 0 and adds exactly 0 to every
//! output element: the padded model computes the same function as the original. Only the order
//! of summation inside a backend's kernels may change with the longer rows (the CPU backend gives
//! bit-identical logits: `crates/backend/tests/tp.rs` checks it).

use quire_backend::{BackendError, HostTensor, ModelWeights, TensorBytes};

/// The model padded with zero heads so that a group of `group` ranks can split it, or `None`
/// when it already can (or when padding heads would not help: another count does not divide).
pub fn pad_heads_for(w: &ModelWeights, group: usize) -> Result<Option<ModelWeights>, BackendError> {
    let c = &w.config;
    if group <= 1 || quire_backend::tp::check_split(c, group).is_ok() {
        return Ok(None);
    }
    let (h, kv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
    if kv == 0 || !h.is_multiple_of(kv) {
        return Ok(None);
    }
    let kv_new = kv.div_ceil(group) * group;
    let h_new = kv_new * (h / kv);
    let mut p = w.clone();
    p.config.num_heads = h_new;
    p.config.num_kv_heads = kv_new;
    if quire_backend::tp::check_split(&p.config, group).is_err() {
        return Ok(None);
    }
    let (q_add, kv_add) = ((h_new - h) * hd, (kv_new - kv) * hd);
    for l in &mut p.layers {
        l.wq = zero_rows(&l.wq, q_add)?;
        l.wk = zero_rows(&l.wk, kv_add)?;
        l.wv = zero_rows(&l.wv, kv_add)?;
        l.wo = zero_columns(&l.wo, q_add)?;
        for (b, add) in [(&mut l.bq, q_add), (&mut l.bk, kv_add), (&mut l.bv, kv_add)] {
            if let Some(t) = b {
                *t = zero_columns(t, add)?;
            }
        }
    }
    Ok(Some(p))
}

fn bad(t: &HostTensor, what: &str) -> BackendError {
    BackendError::Config(format!("padding heads: {}: {what}", t.name))
}

/// Bytes of `n` elements of `t`'s type (whole blocks only).
fn bytes_of(t: &HostTensor, n: usize) -> Result<usize, BackendError> {
    t.dtype
        .row_size(n as u64)
        .map(|b| b as usize)
        .ok_or_else(|| bad(t, &format!("{n} elements are not whole {} blocks", t.dtype)))
}

/// `t` (`[cols, rows]`, ggml order) with `add` zero rows after its own. A zero block is zero in
/// every GGUF type quire reads (its scales are zero).
fn zero_rows(t: &HostTensor, add: usize) -> Result<HostTensor, BackendError> {
    let mut bytes = t.bytes.as_slice().to_vec();
    bytes.resize(bytes.len() + add * bytes_of(t, t.row_len())?, 0);
    Ok(HostTensor {
        dims: vec![t.row_len(), t.rows() + add],
        bytes: TensorBytes::owned(bytes),
        ..t.clone()
    })
}

/// `t` (`[cols, rows]`, or a 1-D vector) with `add` zero columns after its own in every row.
fn zero_columns(t: &HostTensor, add: usize) -> Result<HostTensor, BackendError> {
    let (rb, extra) = (bytes_of(t, t.row_len())?, bytes_of(t, add)?);
    let src = t.bytes.as_slice();
    if src.len() != rb * t.rows().max(1) {
        return Err(bad(t, "bytes do not match its shape"));
    }
    let mut bytes = Vec::with_capacity(src.len() + extra * t.rows().max(1));
    for row in src.chunks(rb) {
        bytes.extend_from_slice(row);
        bytes.resize(bytes.len() + extra, 0);
    }
    let mut dims = t.dims.clone();
    dims[0] += add;
    Ok(HostTensor {
        dims,
        bytes: TensorBytes::owned(bytes),
        ..t.clone()
    })
}
