//! `quire serve-bench`: open-loop load against an OpenAI-compatible server (placeholder, being written).

use anyhow::{bail, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct ServeBenchArgs {
    /// Base URL of the server
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
}

pub fn run(_a: ServeBenchArgs) -> Result<()> {
    bail!("serve-bench is not built yet")
}
