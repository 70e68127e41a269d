//! The draft-model proposer: a smaller model of the same vocabulary, on the same backend as the
//! target, guesses the next K tokens of every speculating row greedily; the target verifies them.
//!
//! The draft has its own executor with its own paged KV cache and block tables (a
//! [`KvCacheManager`] of its own, prefix caching off), kept beside the target's. For each row it
//! remembers which tokens its cache holds. A proposal first rolls that cache back to the longest
//! prefix the row's tokens still share with it — what the target accepted; rejected guesses are
//! dropped exactly as the target's rejected slots are, with [`KvCacheManager::truncate`] — then
//! feeds the tokens it has not seen (the whole prompt the first time, afterwards the target's
//! bonus token, plus the last guess when all were accepted) in one batched step over the rows,
//! whose logits give the first guess, and then runs K - 1 greedy one-token steps over all the rows
//! at once (one chain submission where the backend has one).
//!
//! The draft picks greedily, so its distribution is a point mass on each guess: the rejection
//! sampling of [`crate::spec::accept_sampled`] stays exact for sampled requests, and greedy
//! requests stay token-identical with speculation off, whatever the draft proposes.
//!
//! A row whose draft cache has no room this step proposes nothing (the request goes on without
//! speculation); a row whose unseen tokens do not fit the step's token budget feeds a chunk of
//! them and proposes from the next step on.

use std::collections::HashMap;

use quire_backend::{Executor, ForwardBatch, SeqBatch};
use quire_core::{BlockId, SeqId, TokenId};
use quire_kv::{KvCacheConfig, KvCacheManager};
use quire_tokenizer::Tokenizer;

use crate::proposer::{ProposalRow, Proposer, ProposerStats};
use crate::spec::SpecConfig;
use crate::EngineError;

pub struct DraftModel {
    exec: Box<dyn Executor>,
    kv: KvCacheManager,
    /// Per sequence, the tokens whose KV the draft cache holds (positions `0..len`).
    fed: HashMap<SeqId, Vec<TokenId>>,
    /// Most tokens one catch-up step feeds (the engine's step budget).
    max_batch_tokens: usize,
    no_room: u64,
}

/// A row that takes part in this proposal: its sequence, where its new tokens start in its
/// token list, how many it feeds, and whether they reach its last token (it then proposes).
struct Feed {
    row: usize,
    id: SeqId,
    start: usize,
    len: usize,
    proposes: bool,
}

impl DraftModel {
    /// Wraps a loaded draft model. Refuses one whose vocabulary differs from the target's (the
    /// guesses would be other tokens), naming both sizes, or whose block size is not a power of
    /// two.
    pub fn new(
        exec: Box<dyn Executor>,
        draft_tokenizer: &Tokenizer,
        target_tokenizer: &Tokenizer,
        max_batch_tokens: usize,
    ) -> Result<Self, EngineError> {
        check_same_vocab(draft_tokenizer, target_tokenizer)?;
        let spec = exec.kv_spec();
        let kv = KvCacheManager::try_new(KvCacheConfig {
            num_blocks: spec.num_blocks,
            block_size: spec.block_size,
            enable_prefix_caching: false,
        })
        .map_err(|e| EngineError::Draft(e.to_string()))?;
        Ok(Self {
            exec,
            kv,
            fed: HashMap::new(),
            max_batch_tokens: max_batch_tokens.max(1),
            no_room: 0,
        })
    }

    /// The draft cache's bookkeeping (for tests: its invariants after a run).
    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    /// Rolls `id`'s draft cache back to the prefix it shares with `tokens`, leaving at least the
    /// last token to feed. Returns the number of tokens kept.
    fn roll_back(&mut self, id: SeqId, tokens: &[TokenId]) -> usize {
        let fed = self.fed.entry(id).or_default();
        let common = fed.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        let keep = common.min(tokens.len().saturating_sub(1));
        if keep < fed.len() {
            fed.truncate(keep);
            self.kv.truncate(id, keep);
        }
        keep
    }

    /// Plans this step's catch-up: which rows feed which tokens, with their KV slots allocated
    /// (room for the K - 1 guesses fed after the first too, for rows that propose).
    fn plan(&mut self, rows: &[ProposalRow], k: usize) -> Vec<Feed> {
        let mut budget = self.max_batch_tokens;
        let mut feeds = Vec::new();
        for (i, r) in rows.iter().enumerate() {
            if budget == 0 || r.tokens.is_empty() {
                break;
            }
            let keep = self.roll_back(r.id, r.tokens);
            let unseen = r.tokens.len() - keep;
            let len = unseen.min(budget);
            let proposes = len == unseen;
            let extra = if proposes { k - 1 } else { 0 };
            if !self
                .kv
                .allocate_slots(r.id, r.tokens, keep, len + extra, &[])
            {
                self.no_room += 1;
                continue;
            }
            budget -= len;
            feeds.push(Feed {
                row: i,
                id: r.id,
                start: keep,
                len,
                proposes,
            });
        }
        feeds
    }

    /// Feeds every planned row's unseen tokens in one batch; returns the first guess of every
    /// row that proposes, in `feeds` order of those rows.
    fn catch_up(&mut self, rows: &[ProposalRow], feeds: &[Feed]) -> Result<Vec<u32>, EngineError> {
        let bs = self.kv.block_size();
        let (mut token_ids, mut positions, mut slots, mut logits) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut ranges = Vec::with_capacity(feeds.len());
        for f in feeds {
            let table = self.kv.block_table(f.id);
            let query_start = token_ids.len();
            for (j, t) in rows[f.row].tokens[f.start..f.start + f.len]
                .iter()
                .enumerate()
            {
                let pos = f.start + j;
                token_ids.push(t.0);
                positions.push(pos as u32);
                slots.push(quire_core::slot(table, pos, bs) as u32);
            }
            if f.proposes {
                logits.push((token_ids.len() - 1) as u32);
            }
            ranges.push((query_start, f.len, f.start + f.len));
        }
        let seqs: Vec<SeqBatch> = feeds
            .iter()
            .zip(&ranges)
            .map(|(f, &(query_start, query_len, seq_len))| SeqBatch {
                query_start,
                query_len,
                seq_len,
                block_table: self.kv.block_table(f.id),
            })
            .collect();
        let firsts = self.exec.forward_greedy(&ForwardBatch {
            token_ids: &token_ids,
            positions: &positions,
            slot_mapping: &slots,
            seqs: &seqs,
            logits_indices: &logits,
        })?;
        for f in feeds {
            let fed = self.fed.entry(f.id).or_default();
            fed.extend_from_slice(&rows[f.row].tokens[f.start..f.start + f.len]);
        }
        Ok(firsts)
    }

    /// Runs `k - 1` greedy one-token steps from each row's first guess; returns the guesses
    /// after the first, step-major (`[k - 1][rows]`), and records the fed guesses.
    fn chain(&mut self, ids: &[SeqId], firsts: &[u32], k: usize) -> Result<Vec<u32>, EngineError> {
        if k < 2 || ids.is_empty() {
            return Ok(Vec::new());
        }
        let bs = self.kv.block_size();
        let mut positions = Vec::with_capacity(ids.len());
        let mut slots = Vec::with_capacity(ids.len());
        let mut seqs = Vec::with_capacity(ids.len());
        for (i, id) in ids.iter().enumerate() {
            let pos = self.fed.get(id).map_or(0, Vec::len);
            let table: &[BlockId] = self.kv.block_table(*id);
            positions.push(pos as u32);
            slots.push(quire_core::slot(table, pos, bs) as u32);
            seqs.push(SeqBatch {
                query_start: i,
                query_len: 1,
                seq_len: pos + 1,
                block_table: table,
            });
        }
        let logits: Vec<u32> = (0..ids.len() as u32).collect();
        let out = self.exec.forward_greedy_chain(
            &ForwardBatch {
                token_ids: firsts,
                positions: &positions,
                slot_mapping: &slots,
                seqs: &seqs,
                logits_indices: &logits,
            },
            k - 1,
        )?;
        // The chain fed the first guess and every later one but the last.
        for (i, id) in ids.iter().enumerate() {
            let fed = self.fed.entry(*id).or_default();
            fed.push(TokenId(firsts[i]));
            for step in 0..k - 2 {
                fed.push(TokenId(out[step * ids.len() + i]));
            }
        }
        Ok(out)
    }
}

impl Proposer for DraftModel {
    fn name(&self) -> &'static str {
        "draft"
    }

    fn propose(
        &mut self,
        rows: &[ProposalRow],
        spec: &SpecConfig,
    ) -> Result<Vec<Vec<TokenId>>, EngineError> {
        let k = spec.num_tokens;
        let mut proposals = vec![Vec::new(); rows.len()];
        if k == 0 || rows.is_empty() {
            return Ok(proposals);
        }
        let feeds = self.plan(rows, k);
        if feeds.is_empty() {
            return Ok(proposals);
        }
        let firsts = self.catch_up(rows, &feeds)?;
        let proposing: Vec<&Feed> = feeds.iter().filter(|f| f.proposes).collect();
        let ids: Vec<SeqId> = proposing.iter().map(|f| f.id).collect();
        let rest = self.chain(&ids, &firsts, k)?;
        for (i, f) in proposing.iter().enumerate() {
            let p = &mut proposals[f.row];
            p.push(TokenId(firsts[i]));
            p.extend((0..k - 1).map(|step| TokenId(rest[step * ids.len() + i])));
        }
        Ok(proposals)
    }

    fn release(&mut self, id: SeqId) {
        if self.fed.remove(&id).is_some() {
            // Cannot fail: a sequence with a token list may hold no blocks, which is all it says.
            let _ = self.kv.free(id);
        }
    }

    fn retain(&mut self, live: &[SeqId]) {
        let gone: Vec<SeqId> = self
            .fed
            .keys()
            .filter(|id| !live.contains(id))
            .copied()
            .collect();
        for id in gone {
            self.release(id);
        }
    }

    fn stats(&self) -> ProposerStats {
        ProposerStats {
            kv_blocks_used: self.kv.num_used_blocks(),
            kv_blocks_total: self.kv.num_blocks(),
            no_room: self.no_room,
        }
    }
}

/// The draft must speak the target's vocabulary: the same number of tokens, each the same bytes.
fn check_same_vocab(draft: &Tokenizer, target: &Tokenizer) -> Result<(), EngineError> {
    let (d, t) = (draft.vocab_size(), target.vocab_size());
    if d != t {
        return Err(EngineError::Draft(format!(
            "the draft model's vocabulary has {d} tokens, the target's {t}: a draft must use the \
             target's tokenizer"
        )));
    }
    let differs =
        (0..d as u32).find(|&i| draft.token_bytes(TokenId(i)) != target.token_bytes(TokenId(i)));
    if let Some(i) = differs {
        return Err(EngineError::Draft(format!(
            "the draft model's token {i} differs from the target's (both vocabularies have {d} \
             tokens): a draft must use the target's tokenizer"
        )));
    }
    Ok(())
}
