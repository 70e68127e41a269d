//! A temporary folder for tests that write files (model folders, GGUF files), removed when
//! dropped, so a test leaves nothing behind and two tests never share one.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A fresh empty folder under the system's temporary directory; removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// `quire-test-TAG-PID-N`: unique within the process (N counts) and across processes (PID).
    pub fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "quire-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p)
            .unwrap_or_else(|e| panic!("creating the test folder {}: {e}", p.display()));
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folders_are_distinct_and_removed_on_drop() {
        let (a, b) = (TempDir::new("x"), TempDir::new("x"));
        assert_ne!(a.0, b.0);
        assert!(a.0.is_dir() && b.0.is_dir());
        std::fs::write(a.0.join("f"), b"1").unwrap();
        let p = a.0.clone();
        drop(a);
        assert!(!p.exists(), "{} left behind", p.display());
    }
}
