//! The `braid` command. Its subcommands (pack, inspect, plan, train, forward) arrive
//! with the issues that build them; until then it says so and exits non-zero.

use std::process::ExitCode;

fn main() -> ExitCode {
    let cmd = std::env::args().nth(1);
    eprintln!(
        "braid {}: {} is not available yet; this build has the compute core only \
         (see README.md for what works today)",
        env!("CARGO_PKG_VERSION"),
        cmd.map_or_else(|| "training".to_string(), |c| format!("`{c}`")),
    );
    ExitCode::from(2)
}
