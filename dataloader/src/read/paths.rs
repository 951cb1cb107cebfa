//! Path safety: every media path a manifest names must resolve to a regular file inside the dataset root.
//!
//! Two checks, because either alone is not enough: a lexical one (no absolute paths, no `..`
//! climbing above the root) gives a clear reason before touching the file system, and a
//! canonical one (resolve symlinks, then require the root as a prefix) catches links that point
//! outside. Tar members are never written to disk, but names with `..` or a leading `/` are
//! still refused: a shard that carries them was built wrongly or with intent.

use std::io;
use std::path::{Component, Path, PathBuf};

/// A canonical folder that media paths are resolved against and must stay inside.
#[derive(Debug, Clone)]
pub struct DatasetRoot {
    root: PathBuf,
}

impl DatasetRoot {
    /// Canonicalizes `dir`; fails when it does not exist or is not a folder.
    pub fn new(dir: &Path) -> io::Result<DatasetRoot> {
        let root = dir.canonicalize()?;
        if !root.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotADirectory,
                format!("{} is not a folder", root.display()),
            ));
        }
        Ok(DatasetRoot { root })
    }

    pub fn path(&self) -> &Path {
        &self.root
    }

    /// Resolves a relative media path to a canonical regular file inside the root. The `Err` is
    /// a reject reason that names the path.
    pub fn resolve(&self, rel: &str) -> Result<PathBuf, String> {
        if rel.is_empty() {
            return Err("empty media path".into());
        }
        if rel.contains('\0') {
            return Err(format!("media path {rel:?} contains a NUL byte"));
        }
        let lexical =
            lexically_inside(Path::new(rel)).map_err(|why| format!("media path {rel:?} {why}"))?;
        let joined = self.root.join(lexical);
        let canonical = match joined.canonicalize() {
            Ok(p) => p,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(format!("missing file {rel:?} ({})", joined.display()));
            }
            Err(e) => {
                return Err(format!(
                    "cannot resolve {rel:?} ({}): {e}",
                    joined.display()
                ));
            }
        };
        if !canonical.starts_with(&self.root) {
            return Err(format!(
                "media path {rel:?} resolves to {} outside the dataset root {} (symlink)",
                canonical.display(),
                self.root.display()
            ));
        }
        if !canonical.is_file() {
            return Err(format!("media path {rel:?} is not a regular file"));
        }
        Ok(canonical)
    }
}

/// The normalized relative path when `p` is relative and never climbs above its start; the
/// `Err` completes the sentence "media path X ...".
fn lexically_inside(p: &Path) -> Result<PathBuf, &'static str> {
    let mut out = PathBuf::new();
    let mut depth = 0usize;
    for c in p.components() {
        match c {
            Component::Prefix(_) | Component::RootDir => return Err("is absolute"),
            Component::CurDir => {}
            Component::ParentDir => {
                if depth == 0 {
                    return Err("escapes the dataset root with '..'");
                }
                depth -= 1;
                out.pop();
            }
            Component::Normal(s) => {
                depth += 1;
                out.push(s);
            }
        }
    }
    if depth == 0 {
        return Err("names the dataset root itself, not a file");
    }
    Ok(out)
}

/// Checks a tar member name (raw header bytes): UTF-8, relative, and free of `..` components
/// anywhere (the lexical rule above would allow `a/../b`; a shard has no reason to carry one).
pub fn check_member_name(raw: &[u8]) -> Result<&str, String> {
    let name = std::str::from_utf8(raw)
        .map_err(|_| format!("member name {} is not UTF-8", String::from_utf8_lossy(raw)))?;
    if name.starts_with('/') || name.starts_with('\\') || Path::new(name).is_absolute() {
        return Err(format!("member {name:?} has an absolute name"));
    }
    if name.split(['/', '\\']).any(|c| c == "..") {
        return Err(format!("member {name:?} has a '..' component"));
    }
    if name.contains('\0') {
        return Err(format!("member {name:?} contains a NUL byte"));
    }
    Ok(name)
}
