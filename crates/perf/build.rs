//! Embeds the commit this build was made from, so a result stamp names the code that actually ran
//! rather than whatever checkout the binary happens to be started in. `QUIRE_BUILD_COMMIT` is
//! `git rev-parse --short HEAD`, with `-dirty` when the tree had uncommitted changes (untracked
//! files included) as the build ran, or "unknown" outside a git checkout.
//!
//! The script reruns when HEAD moves (checkout, commit: HEAD, the branch's ref, packed refs), when
//! the index changes, and when any crate's sources or manifests change, so the mark follows the
//! code compiled into the binary. Edits elsewhere (docs) alone do not rebuild, so they may show up
//! in the `-dirty` mark only at the next build of the code.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .stderr(std::process::Stdio::null())
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8(out.stdout).ok()?.trim().to_string())
}

/// Asks cargo to rerun this script when `path` changes (only for paths that exist: a missing
/// one would make cargo rerun it on every build).
fn watch(path: &Path) {
    if path.exists() {
        println!("cargo:rerun-if-changed={}", path.display());
    }
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let commit = match git(&manifest, &["rev-parse", "--short", "HEAD"]).filter(|c| !c.is_empty()) {
        Some(c) => {
            let dirty = git(&manifest, &["status", "--porcelain"]).is_some_and(|s| !s.is_empty());
            if dirty {
                format!("{c}-dirty")
            } else {
                c
            }
        }
        None => "unknown".to_string(),
    };
    println!("cargo:rustc-env=QUIRE_BUILD_COMMIT={commit}");
    if commit == "unknown" {
        return;
    }
    // The git files whose change means another commit or another index.
    let mut git_paths = vec!["HEAD".to_string(), "packed-refs".into(), "index".into()];
    if let Some(r) = git(&manifest, &["symbolic-ref", "-q", "HEAD"]) {
        git_paths.push(r);
    }
    for p in git_paths {
        if let Some(path) = git(
            &manifest,
            &["rev-parse", "--path-format=absolute", "--git-path", &p],
        ) {
            watch(Path::new(&path));
        }
    }
    // Every crate's sources and manifest, and the workspace's.
    let Some(root) = git(&manifest, &["rev-parse", "--show-toplevel"]).map(PathBuf::from) else {
        return;
    };
    watch(&root.join("Cargo.toml"));
    watch(&root.join("Cargo.lock"));
    if let Ok(crates) = std::fs::read_dir(root.join("crates")) {
        for c in crates.flatten() {
            watch(&c.path().join("src"));
            watch(&c.path().join("Cargo.toml"));
            watch(&c.path().join("build.rs"));
        }
    }
}
