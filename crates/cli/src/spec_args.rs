//! Speculative-decoding options shared by `generate` and `bench`: how many tokens the n-gram
//! (prompt lookup) proposer may guess per step, and which n-gram lengths it matches.

use anyhow::{bail, Result};
use clap::Args;
use quire_engine::SpecConfig;

#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// Speculative decoding: propose up to K tokens per step by prompt lookup (the continuation
    /// of the latest earlier occurrence of the last few tokens) and verify them in one forward
    /// pass. Greedy output is unchanged and sampled output keeps its distribution; it pays off
    /// when the output repeats the prompt (editing, copying, code). 0 = off
    #[arg(long, value_name = "K", default_value_t = 0)]
    pub speculative_tokens: usize,
    /// Shortest and longest n-gram the prompt lookup matches, longest tried first
    #[arg(long, value_name = "MIN,MAX", default_value = "1,3")]
    pub spec_ngram: String,
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
        };
        assert!(bad.config().unwrap_err().to_string().contains("MIN <= MAX"));
    }
}
