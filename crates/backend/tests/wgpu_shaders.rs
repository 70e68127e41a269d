//! Every WGSL shader of the wgpu backend through naga (the compiler inside wgpu) to MSL and
//! HLSL: Metal and DX12 have no device here, so a shader those back ends reject shows here. Needs
//! no adapter, only the `wgpu` feature.

#[test]
#[cfg_attr(not(feature = "wgpu"), ignore = "needs --features wgpu")]
fn every_shader_translates_to_msl_and_hlsl() {
    #[cfg(feature = "wgpu")]
    {
        use naga::back::{hlsl, msl};
        use naga::valid::{Capabilities, ValidationFlags, Validator};
        let mut failures = Vec::new();
        for (name, src, entries) in quire_backend::wgpu::kernels::all_sources() {
            let module = match naga::front::wgsl::parse_str(&src) {
                Ok(m) => m,
                Err(e) => {
                    failures.push(format!("{name}: WGSL: {}", e.emit_to_string(&src)));
                    continue;
                }
            };
            // What wgpu grants a device with no optional feature on a full (non-downlevel)
            // Vulkan, Metal or DX12 adapter: f16 packing in f32 shaders, nothing else.
            // A `_subgroup` variant also gets subgroup operations (wgpu requests them only
            // where the adapter has them; its fallback without the suffix is checked too).
            let mut caps = Capabilities::SHADER_FLOAT16_IN_FLOAT32;
            if name.ends_with("_subgroup") {
                caps |= Capabilities::SUBGROUP;
            }
            let info = match Validator::new(ValidationFlags::all(), caps).validate(&module) {
                Ok(i) => i,
                Err(e) => {
                    failures.push(format!("{name}: validation: {}", e.emit_to_string(&src)));
                    continue;
                }
            };
            for entry in entries {
                assert!(
                    module.entry_points.iter().any(|e| e.name == entry),
                    "{name}: no entry point {entry}"
                );
            }
            let opts = msl::Options {
                lang_version: (2, 4),
                ..Default::default()
            };
            let pipe = msl::PipelineOptions::default();
            if let Err(e) = msl::write_string(&module, &info, &opts, &pipe) {
                failures.push(format!("{name}: MSL: {e}"));
            }
            let opts = hlsl::Options {
                shader_model: hlsl::ShaderModel::V6_0,
                ..Default::default()
            };
            let pipe = hlsl::PipelineOptions::default();
            let mut out = String::new();
            let r = hlsl::Writer::new(&mut out, &opts, &pipe).write(&module, &info, None);
            if let Err(e) = r {
                failures.push(format!("{name}: HLSL: {e}"));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}
