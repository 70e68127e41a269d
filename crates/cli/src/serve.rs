//! `quire serve` (placeholder, being written).

use anyhow::{bail, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct ServeArgs {}

pub fn run(_a: ServeArgs) -> Result<()> {
    bail!("serve is not built yet")
}
