//! Reading files a user names (configs, plans, media, model JSON), bounded: a wrong path to
//! a device or an endless stream fails at once instead of reading until memory runs out.

use std::path::Path;

/// Reads a whole file of at most `max` bytes, refusing a device or a folder first
/// (`/dev/zero` would never end) and a file past `max` without reading it all: configs,
/// plans and media named by a user are small, and a wrong path must not read until memory
/// runs out. A pipe (`--config <(...)`) is read up to `max`.
pub fn read_limited(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let meta = std::fs::metadata(path)?;
    let refuse = |msg: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, msg);
    #[cfg(unix)]
    let pipe = std::os::unix::fs::FileTypeExt::is_fifo(&meta.file_type());
    #[cfg(not(unix))]
    let pipe = false;
    if !meta.is_file() && !pipe {
        return Err(refuse("not a regular file (a device or a folder)".into()));
    }
    if meta.len() > max {
        return Err(refuse(format!(
            "{} bytes, more than the {max} expected at most",
            meta.len()
        )));
    }
    let mut out = Vec::new();
    // `take`: a file grown since the metadata was read still stops at the limit.
    std::fs::File::open(path)?
        .take(max + 1)
        .read_to_end(&mut out)?;
    if out.len() as u64 > max {
        return Err(refuse(format!(
            "more than the {max} bytes expected at most"
        )));
    }
    Ok(out)
}
