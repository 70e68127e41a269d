//! The one-token GEMV for the 4-, 5- and 6-bit types with a whole 16-byte unit per invocation
//! (shaders/gemv_q.wgsl says why: the slot kernel's arithmetic per value, not memory, bounded
//! Q4_K and Q6_K decode on the H100). It shares the slot kernel's grid, reductions and entry
//! point (`gemv_slot`), so [`super::gemv::Gemv::Unit`] runs wherever a slot design does.

use super::gemv::GemvIn;
use super::kernels::{section, WType};

/// The unit kernel's shader text (a prelude and a section per type).
pub const GEMV_Q: &str = include_str!("shaders/gemv_q.wgsl");

/// Whether the unit kernel has a form for weights of type `t`.
pub fn supports(t: WType) -> bool {
    matches!(
        t,
        WType::Q4_K | WType::Q5_K | WType::Q6_K | WType::Q4_0 | WType::Q4_1
    )
}

/// The unit kernel's module for `rows` rows per workgroup of `wg` invocations, weights of type
/// `t` (which [`supports`] must accept), summing through subgroups or workgroup memory, reading
/// its activations and writing its rows as `input` says.
pub fn source(t: WType, rows: u32, wg: u32, subgroup: bool, input: GemvIn) -> String {
    assert!(supports(t), "no unit GEMV for {}", t.name());
    let (prelude, body) = section(GEMV_Q, t.name());
    super::gemv::slot_module(t, rows, wg, subgroup, input, &format!("{prelude}\n{body}"))
}
