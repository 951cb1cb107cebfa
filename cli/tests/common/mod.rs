//! Helpers the CLI's end-to-end test files share: run the `braid` binary, read its output.
#![allow(dead_code, clippy::unwrap_used)]

use std::process::{Command, Output};

/// `braid ARGS..` from the test's working directory, to completion.
pub fn braid(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(args)
        .output()
        .unwrap()
}

/// `braid ARGS..` from the repository root (where `configs/` is), to completion.
pub fn braid_at_root(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_braid"))
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .args(args)
        .output()
        .unwrap()
}

/// Stdout then stderr, as one text.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
