//! quire's performance toolkit as a library, so every command measures and reports the same way:
//! summary statistics of timing samples, peak memory, the stamp that says which commit ran on which machine,
//! writers for markdown / CSV / JSON / JSONL, a confidence interval for "B is x× faster than A",
//! the machine's measured ceilings (memory bandwidth, FLOP/s) and the roofline chart that places
//! results under them. It knows nothing about models or backends; the CLI wires it to them.

pub mod ceilings;
pub mod chips;
pub mod mem;
pub mod output;
pub mod ratio;
pub mod roofline;
pub mod stamp;
pub mod stats;

pub use ceilings::Ceilings;
pub use output::{Format, Table};
pub use ratio::{ratio_ci, RatioCi};
pub use roofline::{Roof, RoofPoint, Roofline};
pub use stamp::RunStamp;
pub use stats::Summary;

#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    #[error("{0}")]
    Io(String),
    #[error("parse error: {0}")]
    Parse(String),
    #[error("chart: {0}")]
    Chart(String),
}
