//! `quire adapters`: the GPU adapters the wgpu backend can run on (the numbers `--adapter N`
//! takes), with the API, device type, driver and the optional features quire may use.

use anyhow::{bail, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct AdaptersArgs {
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: AdaptersArgs) -> Result<()> {
    let list = match quire_backend::wgpu::adapters() {
        Ok(l) => l,
        Err(quire_backend::BackendError::NotBuilt(b)) => {
            bail!("backend {b} was not built into this binary (build with `cargo build --release --features {b}`)")
        }
        Err(e) => return Err(e.into()),
    };
    if a.json {
        let rows: Vec<_> = list
            .iter()
            .map(|x| {
                serde_json::json!({
                    "index": x.index, "name": x.name, "backend": x.backend,
                    "device_type": x.device_type, "driver": x.driver, "features": x.features,
                    "max_storage_binding_bytes": x.max_storage_binding,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    if list.is_empty() {
        println!(
            "no adapter found (no Vulkan, Metal or DX12 driver; on Debian \
             `apt-get install mesa-vulkan-drivers libvulkan1` gives lavapipe, a CPU one)"
        );
        return Ok(());
    }
    for x in &list {
        println!(
            "{}: {} ({}, {}), driver {}, storage binding {} MiB, features: {}",
            x.index,
            x.name,
            x.backend,
            x.device_type,
            if x.driver.is_empty() { "?" } else { &x.driver },
            x.max_storage_binding >> 20,
            if x.features.is_empty() {
                "none".to_string()
            } else {
                x.features.join(" ")
            }
        );
    }
    Ok(())
}
