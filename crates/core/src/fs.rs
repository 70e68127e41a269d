//! Refusing paths that are not regular files before opening them. Opening a FIFO for reading
//! blocks until some other process opens it for writing, so a model path, shard, tokenizer or
//! config that names one would hang `quire` forever; a device or a directory gives confusing
//! errors later. Model inputs are checked with [`regular_file`] first and refused by name.

use std::path::Path;

/// `Ok` when `path` (after following symlinks) is a regular file; otherwise an error whose
/// message says what it is instead (missing, a directory, a FIFO, a device, a socket).
pub fn regular_file(path: &Path) -> std::io::Result<()> {
    let meta = std::fs::metadata(path)?;
    if meta.is_file() {
        return Ok(());
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("{} is not a regular file", describe(&meta.file_type())),
    ))
}

fn describe(t: &std::fs::FileType) -> &'static str {
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    "a special file"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_what_a_path_is() {
        let dir = std::env::temp_dir();
        let e = regular_file(&dir).unwrap_err();
        assert_eq!(e.to_string(), "a directory is not a regular file");
        assert_eq!(
            regular_file(Path::new("/nonexistent/x"))
                .unwrap_err()
                .kind(),
            std::io::ErrorKind::NotFound
        );
        #[cfg(unix)]
        {
            let e = regular_file(Path::new("/dev/null")).unwrap_err();
            assert_eq!(e.to_string(), "a device is not a regular file");
        }
        let f = dir.join(format!("quire-core-fs-{}", std::process::id()));
        std::fs::write(&f, b"x").unwrap();
        assert!(regular_file(&f).is_ok());
        let _ = std::fs::remove_file(f);
    }
}
