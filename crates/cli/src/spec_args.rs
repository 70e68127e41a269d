//! Speculative-decoding options shared by `generate`, `chat`, `serve` and `bench`: how many tokens
//! are guessed per step, and by what — prompt lookup (which n-gram lengths it matches) or a draft
//! model loaded beside the target.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use quire_engine::{Engine, SpecConfig};

use crate::common::{cuda_executor, executor, kv_spec, load_model, EngineArgs, ModelArgs};

#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// Speculative decoding: propose up to K tokens per step by prompt lookup (the continuation
    /// of the earlier text the output is copying, followed across steps; fewer after a miss)
    /// and verify them in one forward pass. Greedy output is unchanged and sampled output keeps
    /// its distribution; it pays off when the output repeats the prompt (editing, copying,
    /// code). 0 = off
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub speculative_tokens: usize,
    /// Shortest and longest n-gram the prompt lookup matches, longest tried first
    #[arg(long, value_name = "MIN,MAX", default_value = "1,3")]
    pub spec_ngram: String,
    /// Speculative decoding with a draft model instead of prompt lookup: a smaller model with the
    /// target's tokenizer (e.g. a 1B beside an 8B of the same family), on the same backend with a
    /// KV cache of its own, guesses K tokens greedily per step. Its cache is sized like the
    /// target's (--kv-cache-mb / --num-blocks); on CUDA it is loaded after the target, into the
    /// memory the target left, so give the target --num-blocks (or a lower
    /// --gpu-memory-utilization) to leave room for it. Needs --speculative-tokens K; refused when
    /// the vocabularies differ. CPU and CUDA backends.
    #[arg(long, value_name = "FILE")]
    pub draft_model: Option<PathBuf>,
}

impl SpecArgs {
    pub fn config(&self) -> Result<SpecConfig> {
        let (min, max) = parse_range(&self.spec_ngram)?;
        let c = SpecConfig {
            num_tokens: self.speculative_tokens,
            ngram_min: min,
            ngram_max: max,
        };
        if let Err(e) = c.validate() {
            bail!("--speculative-tokens / --spec-ngram: {e}");
        }
        Ok(c)
    }

    /// Sets the engine's speculation as asked, loading the draft model when one is given.
    pub fn apply(&self, engine: &mut Engine, m: &ModelArgs, e: &EngineArgs) -> Result<()> {
        let c = self.config()?;
        if let Some(path) = &self.draft_model {
            if c.num_tokens == 0 {
                bail!("--draft-model needs --speculative-tokens K (how many tokens the draft guesses per step, e.g. 4)");
            }
            attach_draft(engine, path, m, e)?;
        }
        engine.set_speculation(c)?;
        Ok(())
    }
}

/// Loads `path` as the draft model of `engine` on the target's backend, with its own KV cache.
pub fn attach_draft(engine: &mut Engine, path: &Path, m: &ModelArgs, e: &EngineArgs) -> Result<()> {
    if m.backend != "cpu" && m.backend != "cuda" {
        bail!(
            "--draft-model runs on --backend cpu or cuda, not {} yet; prompt lookup \
             (--speculative-tokens K without --draft-model) runs everywhere",
            m.backend
        );
    }
    let dargs = ModelArgs {
        model: Some(path.to_path_buf()),
        ..m.clone()
    };
    let draft = load_model(&dargs).context("--draft-model")?;
    let exec = if m.backend == "cuda" {
        // The pool is sized from the memory the target left (or --num-blocks).
        cuda_executor(
            &draft,
            &dargs,
            (e.num_blocks, e.block_size),
            &e.kv_dtype,
            e.max_num_batched_tokens(&m.backend),
        )?
    } else {
        executor(&draft, &dargs, kv_spec(&draft, e)?, &e.kv_dtype)?
    };
    engine
        .set_draft_model(exec, &draft.tokenizer)
        .with_context(|| format!("--draft-model {}", path.display()))
}

/// `"MIN,MAX"` (or a single `"N"` for MIN = MAX = N).
pub fn parse_range(s: &str) -> Result<(usize, usize)> {
    let parse = |x: &str| {
        x.trim()
            .parse::<usize>()
            .map_err(|_| anyhow::anyhow!("--spec-ngram wants MIN,MAX (two integers), got {s:?}"))
    };
    match s.split_once(',') {
        Some((a, b)) => Ok((parse(a)?, parse(b)?)),
        None => {
            let n = parse(s)?;
            Ok((n, n))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngram_ranges_parse_or_explain() {
        assert_eq!(parse_range("1,3").unwrap(), (1, 3));
        assert_eq!(parse_range(" 2 , 4").unwrap(), (2, 4));
        assert_eq!(parse_range("2").unwrap(), (2, 2));
        assert!(parse_range("a,3").is_err());
        let bad = SpecArgs {
            speculative_tokens: 4,
            spec_ngram: "3,1".into(),
            draft_model: None,
        };
        assert!(bad.config().unwrap_err().to_string().contains("MIN <= MAX"));
    }
}
