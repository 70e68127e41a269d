//! The engine step's guided (structured-output) rows: their next-token masks, computed several at
//! once, and the greedy picks of rows that need nothing but logits and a mask, made in parallel.

use std::collections::HashMap;

use quire_core::{SeqId, TokenId};

use super::RequestState;
use crate::constrain::{self, Grammars, GreedyRow, Guide, MaskResult};

/// The picks of the step's guided greedy rows that need nothing but their logits and mask (no
/// proposals, penalties or log-probabilities), made by [`constrain::greedy_picks`] (rows in
/// parallel). Takes those rows' masks out of `masks`.
///
/// `logits`: ([rows, vocab], vocab).
pub(super) fn guided_greedy_picks(
    requests: &mut HashMap<SeqId, RequestState>,
    grammars: &Grammars,
    masks: &mut HashMap<SeqId, MaskResult>,
    sampling: &[(SeqId, usize)],
    proposals: &HashMap<SeqId, &[TokenId]>,
    logits: (&[f32], usize),
    dead_end: TokenId,
) -> HashMap<SeqId, TokenId> {
    let rows: HashMap<SeqId, usize> = sampling
        .iter()
        .filter(|(id, _)| !proposals.contains_key(id))
        .copied()
        .collect();
    let work: Vec<GreedyRow> = requests
        .iter_mut()
        .filter_map(|(&id, r)| {
            let row = *rows.get(&id)?;
            if !r.sampler.is_greedy_under_mask() {
                return None;
            }
            Some(GreedyRow {
                id,
                row,
                guide: r.guide.as_mut()?,
                end: &mut r.grammar_end,
                mask: masks.remove(&id)?,
            })
        })
        .collect();
    constrain::greedy_picks(work, grammars, logits, dead_end)
}

/// The next-token masks of the guided requests among the step's sampling rows
/// ([`constrain::masks`]: several at once).
pub(super) fn guide_masks(
    requests: &mut HashMap<SeqId, RequestState>,
    sampling: &[(SeqId, usize)],
) -> HashMap<SeqId, MaskResult> {
    let rows: std::collections::HashSet<SeqId> = sampling.iter().map(|&(id, _)| id).collect();
    let guides: Vec<(SeqId, &mut Guide)> = requests
        .iter_mut()
        .filter(|(id, _)| rows.contains(id))
        .filter_map(|(&id, r)| Some((id, r.guide.as_mut()?)))
        .collect();
    constrain::masks(guides)
}
