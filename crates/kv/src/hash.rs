//! Block hashes for prefix caching.
//!
//! A full block is named by `hash(parent_block_hash, its token ids)`, so equal hashes mean equal
//! prefixes up to and including that block (barring a 64-bit collision), not merely equal block
//! contents. The first block's parent is a fixed seed. The function is our own xxhash64-style mix:
//! no dependency, deterministic across processes and runs (unlike `RandomState`), and fast enough to
//! rehash a prompt on every admission.

use quire_core::TokenId;

/// The chained hash of one full block (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u64);

/// Parent of the first block of every sequence.
pub const ROOT_BLOCK_HASH: BlockHash = BlockHash(0x7175_6972_655f_6b76); // "quire_kv"

const P1: u64 = 0x9E37_79B1_85EB_CA87;
const P2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const P3: u64 = 0x1656_67B1_9E37_79F9;

/// Hashes one block's tokens chained to its parent's hash (`None` = first block of a sequence).
pub fn hash_block_tokens(parent: Option<BlockHash>, tokens: &[TokenId]) -> BlockHash {
    let parent = parent.unwrap_or(ROOT_BLOCK_HASH).0;
    let mut acc = parent ^ P3.wrapping_mul(tokens.len() as u64 + 1);
    for t in tokens {
        acc = acc.wrapping_add(u64::from(t.0).wrapping_mul(P2));
        acc = acc.rotate_left(31).wrapping_mul(P1);
    }
    BlockHash(fmix64(acc ^ parent.rotate_left(17)))
}

/// MurmurHash3's finaliser: every input bit affects every output bit.
fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(v: &[u32]) -> Vec<TokenId> {
        v.iter().copied().map(TokenId).collect()
    }

    #[test]
    fn deterministic_and_chained() {
        let a = hash_block_tokens(None, &toks(&[1, 2, 3, 4]));
        assert_eq!(a, hash_block_tokens(None, &toks(&[1, 2, 3, 4])));
        assert_ne!(a, hash_block_tokens(None, &toks(&[1, 2, 4, 3])));
        // Same tokens, different parent: different hash.
        let b1 = hash_block_tokens(Some(a), &toks(&[5, 6, 7, 8]));
        let b2 = hash_block_tokens(None, &toks(&[5, 6, 7, 8]));
        assert_ne!(b1, b2);
        // Token 0 is not a no-op.
        assert_ne!(
            hash_block_tokens(None, &toks(&[0])),
            hash_block_tokens(None, &toks(&[0, 0]))
        );
    }
}
