//! Helpers shared by the integration tests: locating the real model file and
//! scratch paths. (Each test binary uses a different subset.)
#![allow(dead_code)]

use std::path::PathBuf;

const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The default model: `$QUIRE_MODEL`, else `$XDG_CACHE_HOME/quire/<file>`,
/// else `~/.cache/quire/<file>`. Panics (failing the test) with instructions
/// when it is missing: these tests are meant to run against the real file.
pub fn model_path() -> PathBuf {
    let path = if let Some(p) = std::env::var_os("QUIRE_MODEL").filter(|p| !p.is_empty()) {
        PathBuf::from(p)
    } else {
        let cache = std::env::var_os("XDG_CACHE_HOME")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .expect("neither XDG_CACHE_HOME nor HOME is set; set QUIRE_MODEL to the model path");
        cache.join("quire").join(MODEL_FILE)
    };
    assert!(
        path.is_file(),
        "model file {} not found: run `quire generate` once to download it, \
         or set QUIRE_MODEL to a local copy of {MODEL_FILE}",
        path.display()
    );
    path
}

/// A fresh path in the system temp dir, unique per process and `tag`.
pub fn temp_path(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("quire-gguf-{}-{tag}.gguf", std::process::id()))
}
