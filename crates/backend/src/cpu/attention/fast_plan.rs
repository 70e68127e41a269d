//! How the fast attention kernel's work is cut into tasks.
//!
//! Every query row's keys are cut into ranges at fixed absolute positions (multiples of
//! `SPLIT_KEYS`), so a row's arithmetic depends neither on the thread count nor on the batch or
//! the chunking of its prompt. Consecutive rows of one sequence (the rows of a prompt chunk) also
//! share most of those ranges: a range that every row of a run has whole is walked once for all
//! of them, each key's K and V rows read and converted once for every row's heads, and each row
//! still gets exactly the partial its own task would have left. A row's other ranges (near its
//! own position, where its neighbours' keys end elsewhere) get tasks of their own.

use std::ops::Range;

use super::{AttnParams, SPLIT_KEYS};
use crate::SeqBatch;

/// One task: key range `keys` of the rows `rows` (indices into the batch, one sequence,
/// consecutive positions) for KV heads `kvh0 .. kvh0 + heads`.
pub(super) struct Task {
    pub rows: Range<usize>,
    pub kvh0: usize,
    pub keys: Range<usize>,
}

/// The tasks of one call and where each (row, KV head) finds its partials.
pub(super) struct Plan {
    pub tasks: Vec<Task>,
    /// KV heads per task.
    pub heads: usize,
    /// Where task `t`'s partials start in the partial buffer (in partials; the buffer holds
    /// `offsets[tasks.len()]`). A task's partials are `[row in task][head in task]`.
    pub offsets: Vec<usize>,
    /// (row, KV head, range of `refs`): the partials of one row and KV head, in key order.
    pub groups: Vec<(usize, usize, Range<usize>)>,
    /// Partial indices, in the order `groups` names them.
    pub refs: Vec<usize>,
}

/// The key ranges of the row at position `pos`: its keys cut at multiples of `SPLIT_KEYS`.
fn cut(p: &AttnParams, pos: usize) -> Vec<Range<usize>> {
    let keys = p.first_key(pos)..pos + 1;
    let mut v = Vec::new();
    let mut a = keys.start;
    while a < keys.end {
        let b = ((a / SPLIT_KEYS + 1) * SPLIT_KEYS).min(keys.end);
        v.push(a..b);
        a = b;
    }
    v
}

impl Plan {
    /// Plans `rows` (each one query row, `query_len == 1`) with runs of at most `max_rows` rows
    /// per shared task. A task covers every KV head when there are enough tasks to keep
    /// `threads` busy (it then reads each cache row whole: a slot's KV heads lie side by side),
    /// one KV head otherwise; a head's arithmetic is the same either way.
    pub fn new(p: &AttnParams, rows: &[SeqBatch], threads: usize, max_rows: usize) -> Plan {
        let all = Plan::with_heads(p, rows, max_rows.max(1), p.num_kv_heads);
        if all.tasks.len() >= 4 * threads || p.num_kv_heads == 1 {
            all
        } else {
            Plan::with_heads(p, rows, max_rows.max(1), 1)
        }
    }

    fn with_heads(p: &AttnParams, rows: &[SeqBatch], max_rows: usize, heads: usize) -> Plan {
        let mut tasks = Vec::new();
        // (task, row in task) for each (row, kv head block, range), in key order.
        let mut row_refs: Vec<Vec<(usize, usize)>> = Vec::with_capacity(rows.len());
        let mut i = 0;
        while i < rows.len() {
            let mut j = i + 1;
            while j < rows.len()
                && j - i < max_rows
                && std::ptr::eq(rows[j].block_table, rows[i].block_table)
                && rows[j].seq_len == rows[j - 1].seq_len + 1
            {
                j += 1;
            }
            let lists: Vec<Vec<Range<usize>>> =
                rows[i..j].iter().map(|r| cut(p, r.seq_len - 1)).collect();
            let shared: Vec<Range<usize>> = if j - i > 1 {
                lists[0]
                    .iter()
                    .filter(|rg| lists[1..].iter().all(|l| l.contains(rg)))
                    .cloned()
                    .collect()
            } else {
                Vec::new()
            };
            // The shared tasks of this run: (range index in `shared`, head block) → task.
            let first_shared = tasks.len();
            for rg in &shared {
                for kvh0 in (0..p.num_kv_heads).step_by(heads) {
                    tasks.push(Task {
                        rows: i..j,
                        kvh0,
                        keys: rg.clone(),
                    });
                }
            }
            let blocks = p.num_kv_heads.div_ceil(heads);
            for (k, list) in lists.iter().enumerate() {
                let mut refs = Vec::with_capacity(list.len() * blocks);
                for (b, kvh0) in (0..p.num_kv_heads).step_by(heads).enumerate() {
                    for rg in list {
                        match shared.iter().position(|s| s == rg) {
                            Some(si) => refs.push((first_shared + si * blocks + b, k)),
                            None => {
                                tasks.push(Task {
                                    rows: i + k..i + k + 1,
                                    kvh0,
                                    keys: rg.clone(),
                                });
                                refs.push((tasks.len() - 1, 0));
                            }
                        }
                    }
                }
                row_refs.push(refs);
            }
            i = j;
        }
        let mut offsets = Vec::with_capacity(tasks.len() + 1);
        let mut at = 0;
        for t in &tasks {
            offsets.push(at);
            at += t.rows.len() * heads;
        }
        offsets.push(at);
        // Each (row, head block)'s references run in key order; a block's heads share them.
        let mut groups = Vec::with_capacity(rows.len() * p.num_kv_heads);
        let mut refs = Vec::new();
        for (row, rr) in row_refs.iter().enumerate() {
            let per_block = rr.len() / p.num_kv_heads.div_ceil(heads);
            for (b, block) in rr.chunks(per_block.max(1)).enumerate() {
                for h in 0..heads {
                    let kvh = b * heads + h;
                    if kvh >= p.num_kv_heads {
                        break;
                    }
                    let start = refs.len();
                    refs.extend(block.iter().map(|&(t, r)| offsets[t] + r * heads + h));
                    groups.push((row, kvh, start..refs.len()));
                }
            }
        }
        Plan {
            tasks,
            heads,
            offsets,
            groups,
            refs,
        }
    }
}
