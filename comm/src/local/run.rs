//! Running a world of threads: one thread per rank, a failure in any of them poisons
//! the world, and the caller learns which rank failed first.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::{LocalComm, LocalWorld};

/// A failed world: the rank that failed first and why, plus every rank's own error.
#[derive(Debug)]
pub struct WorldFailure {
    /// The world rank whose error or panic poisoned the world.
    pub rank: usize,
    pub message: String,
    /// Every rank that did not succeed, with its own message (the others mostly say
    /// they were poisoned by `rank`).
    pub ranks: Vec<(usize, String)>,
}

impl fmt::Display for WorldFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} failed: {}", self.rank, self.message)
    }
}

impl std::error::Error for WorldFailure {}

/// Runs `f` on each of `size` ranks, each on its own thread (named `rank-N`) with its
/// world [`LocalComm`], and returns their results in rank order. The first rank to
/// return `Err` or panic poisons the world (so the others stop instead of waiting for
/// it), and the whole call returns a [`WorldFailure`] naming it.
pub fn run_local<T: Send, E: fmt::Display>(
    size: usize,
    timeout: Duration,
    f: impl Fn(LocalComm) -> std::result::Result<T, E> + Sync,
) -> std::result::Result<Vec<T>, WorldFailure> {
    let world = LocalWorld::new(size, timeout);
    let results: Vec<std::result::Result<T, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let world = Arc::clone(&world);
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .stack_size(16 << 20)
                    .spawn_scoped(s, move || {
                        let outcome =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                match LocalComm::world(&world, rank) {
                                    Ok(comm) => f(comm).map_err(|e| e.to_string()),
                                    Err(e) => Err(e.to_string()),
                                }
                            }));
                        let outcome = outcome.unwrap_or_else(|p| Err(panic_message(p.as_ref())));
                        if let Err(why) = &outcome {
                            world.poison(rank, why.clone());
                        }
                        outcome
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|p| Err(panic_message(p.as_ref()))),
                Err(e) => {
                    let why = format!("could not start thread: {e}");
                    world.poison(rank, why.clone());
                    Err(why)
                }
            })
            .collect()
    });
    let ranks: Vec<(usize, String)> = results
        .iter()
        .enumerate()
        .filter_map(|(r, x)| x.as_ref().err().map(|e| (r, e.clone())))
        .collect();
    if let Some((rank, message)) = world.failure() {
        return Err(WorldFailure {
            rank,
            message,
            ranks,
        });
    }
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            r.map_err(|message| WorldFailure {
                rank,
                message,
                ranks: ranks.clone(),
            })
        })
        .collect()
}

/// The text of a panic payload.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    let text = p
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(non-string panic payload)".into());
    format!("panicked: {text}")
}
