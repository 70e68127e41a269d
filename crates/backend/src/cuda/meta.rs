//! A decode step's metadata (token ids, positions, slot mapping, sequences and block tables) as
//! the kernels read it: packed for a CUDA graph's batch bucket, and, for small steps, handed to
//! the device through mapped page-locked memory instead of a copy.
//!
//! Why mapped: a graph replay otherwise follows a host-to-device copy, a second submission the
//! GPU runs before the graph's first kernel. With `MappedMeta` the host writes the words into
//! page-locked memory and the graph's first kernel (`embed_f16_meta`) copies them to the
//! device's metadata buffer over the bus itself.

use super::attention::Meta;
use super::gpu::HostBuf;
use crate::{BackendError, ForwardBatch};

/// Metadata of a decode batch padded to `b` rows. The array offsets depend on `b` alone (a
/// captured graph bakes them in); block tables are packed one after another behind them, each
/// sequence finding its own through `SeqInfo.bt_offset` (data, not baked). Padding rows are
/// one-token sequences in block `pad_block`, which the engine never hands out.
pub(super) fn pack_meta_padded(
    batch: &ForwardBatch,
    b: usize,
    pad_block: usize,
    block_size: usize,
    m: &mut Vec<i32>,
) -> Meta {
    let n = batch.num_tokens();
    // Arrays start at multiples of four words: the SeqInfo array is read as 16-byte int4.
    let w = b.div_ceil(4) * 4;
    let layout = Meta {
        tokens: 0,
        positions: w,
        slots: 2 * w,
        row_seq: 3 * w,
        logits_idx: 4 * w,
        seqs: 5 * w,
        block_tables: 5 * w + 4 * b,
        tiles: 0,
        num_tiles: 0,
        tiled_rows: 0,
    };
    m.clear();
    m.resize(layout.block_tables, 0);
    let mut bt_offset = 0usize;
    for i in 0..b {
        let real = i < n;
        m[i] = if real { batch.token_ids[i] as i32 } else { 0 };
        m[layout.positions + i] = if real { batch.positions[i] as i32 } else { 0 };
        m[layout.slots + i] = if real {
            batch.slot_mapping[i] as i32
        } else {
            (pad_block * block_size) as i32
        };
        m[layout.row_seq + i] = i as i32;
        m[layout.logits_idx + i] = i as i32;
        let len = if real { batch.seqs[i].seq_len } else { 1 };
        let at = layout.seqs + 4 * i;
        m[at..at + 4].copy_from_slice(&[i as i32, 1, len as i32, bt_offset as i32]);
        if real {
            let bt = batch.seqs[i].block_table;
            m.extend(bt.iter().map(|id| id.as_usize() as i32));
            bt_offset += bt.len();
        } else {
            m.push(pad_block as i32);
            bt_offset += 1;
        }
    }
    layout
}

/// Most words a step's metadata may have to go through `MappedMeta` (one 256-thread CTA copies
/// this many 4-word vectors in one pass).
pub(super) const MAPPED_META_WORDS: usize = 1024;

/// Page-locked host memory the device reads, for the metadata of small decode steps.
pub(super) struct MappedMeta {
    buf: HostBuf<i32>,
    /// Its device address.
    pub dev: u64,
}

impl MappedMeta {
    pub fn new() -> Result<Self, BackendError> {
        let (buf, dev) = HostBuf::mapped(MAPPED_META_WORDS)?;
        Ok(MappedMeta { buf, dev })
    }

    /// Writes `meta` for the next step and returns how many words the device copies: `meta`'s
    /// length rounded up to a power of two, at least 64 (a graph bakes it in, so steps whose
    /// block tables grow a little reuse it); `None` when it does not fit (copy it instead). The
    /// caller must have synchronized with every step that read the buffer before.
    pub fn stage(&mut self, meta: &[i32]) -> Option<usize> {
        let words = mapped_words(meta.len())?;
        let dst = self.buf.slice_mut(MAPPED_META_WORDS).ok()?;
        dst[..meta.len()].copy_from_slice(meta);
        Some(words)
    }
}

/// The words the device copies for `len` words of metadata (see `MappedMeta::stage`).
fn mapped_words(len: usize) -> Option<usize> {
    let words = len.next_power_of_two().max(64);
    (words <= MAPPED_META_WORDS).then_some(words)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SeqBatch;
    use quire_core::BlockId;

    #[test]
    fn mapped_metadata_copies_a_power_of_two_of_at_least_64_words_up_to_the_buffer() {
        assert_eq!(mapped_words(0), Some(64));
        assert_eq!(mapped_words(27), Some(64));
        assert_eq!(mapped_words(65), Some(128));
        assert_eq!(mapped_words(1024), Some(1024));
        assert_eq!(mapped_words(1025), None);
        // Every copy is whole 4-word vectors (embed_f16_meta copies int4s).
        assert!((0..=1024).all(|n| mapped_words(n).is_none_or(|w| w >= n && w % 4 == 0)));
    }

    #[test]
    fn padded_metadata_keeps_seq_info_16_byte_aligned_and_pads_into_the_spare_block() {
        for n in [1usize, 2, 3, 5, 7] {
            let tables: Vec<Vec<BlockId>> = (0..n).map(|i| vec![BlockId(i as u32)]).collect();
            let seqs: Vec<SeqBatch> = (0..n)
                .map(|i| SeqBatch {
                    query_start: i,
                    query_len: 1,
                    seq_len: 3,
                    block_table: &tables[i],
                })
                .collect();
            let ids = vec![7u32; n];
            let pos = vec![2u32; n];
            let slots: Vec<u32> = (0..n as u32).map(|i| i * 16 + 2).collect();
            let li: Vec<u32> = (0..n as u32).collect();
            let batch = ForwardBatch {
                token_ids: &ids,
                positions: &pos,
                slot_mapping: &slots,
                seqs: &seqs,
                logits_indices: &li,
            };
            let b = n.next_power_of_two();
            let mut m = vec![];
            let l = pack_meta_padded(&batch, b, 99, 16, &mut m);
            for off in [
                l.positions,
                l.slots,
                l.row_seq,
                l.logits_idx,
                l.seqs,
                l.block_tables,
            ] {
                assert_eq!(off % 4, 0, "n {n}: offset {off} not 16-byte aligned");
            }
            for i in 0..b {
                let s = &m[l.seqs + 4 * i..l.seqs + 4 * i + 4];
                assert_eq!(s[0], i as i32);
                if i < n {
                    assert_eq!(
                        (s[2], m[l.slots + i], m[l.block_tables + s[3] as usize]),
                        (3, slots[i] as i32, i as i32)
                    );
                } else {
                    assert_eq!(
                        (s[2], m[l.slots + i], m[l.block_tables + s[3] as usize]),
                        (1, 99 * 16, 99)
                    );
                }
            }
        }
    }
}
