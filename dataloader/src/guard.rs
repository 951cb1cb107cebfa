//! Third-party code run on untrusted bytes (image and audio decoders, the tokenizers
//! library): a panic inside it becomes an error carrying the panic's message and place,
//! and prints nothing, so a hostile file is one reject with a reason rather than a dead
//! worker, and a pack of many such files is not buried in backtraces.

use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, PanicHookInfo, catch_unwind};
use std::sync::Once;

thread_local! {
    /// How deep this thread is inside [`catch`] calls.
    static GUARDED: Cell<u32> = const { Cell::new(0) };
    /// The message of the last panic caught on this thread.
    static CAUGHT: RefCell<Option<String>> = const { RefCell::new(None) };
}

static HOOK: Once = Once::new();

fn message(info: &PanicHookInfo<'_>) -> String {
    let payload = info.payload();
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into());
    match info.location() {
        Some(l) => {
            // A dependency's file as `crate-version/src/...`, without the registry's path.
            let file = l.file();
            let file = file
                .split_once("/registry/src/")
                .and_then(|(_, rest)| rest.split_once('/'))
                .map_or(file, |(_, krate)| krate);
            format!("{what} (at {file}:{})", l.line())
        }
        None => what,
    }
}

/// Runs `f`; a panic inside it is `Err(its message)`, recorded instead of printed. Panics
/// elsewhere (other threads, or this one outside `catch`) print as before. `f` must not
/// hand work to a thread pool: a pool thread waiting in it could run another task, whose
/// panic this thread's guard would then silence.
pub fn catch<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if GUARDED.with(Cell::get) > 0 {
                CAUGHT.with(|c| *c.borrow_mut() = Some(message(info)));
            } else {
                previous(info);
            }
        }));
    });
    // A panic caught inside `f` itself must not be taken for `f`'s own.
    CAUGHT.with(|c| c.borrow_mut().take());
    GUARDED.with(|g| g.set(g.get() + 1));
    let out = catch_unwind(AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(g.get() - 1));
    out.map_err(|_| {
        CAUGHT
            .with(|c| c.borrow_mut().take())
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_caught_panic_is_its_message_and_place() {
        let e = catch(|| -> u32 { panic!("bad header {}", 7) }).unwrap_err();
        assert!(e.contains("bad header 7") && e.contains("guard.rs"), "{e}");
        // A panic caught (and handled) inside `f` is not reported as `f`'s.
        let inner_then_ok = catch(|| {
            let _ = std::panic::catch_unwind(|| panic!("handled inside"));
            5
        });
        assert_eq!(inner_then_ok.unwrap(), 5);
        let after = catch(|| -> u32 { std::panic::resume_unwind(Box::new(1u8)) }).unwrap_err();
        assert!(!after.contains("handled inside"), "{after}");
        assert_eq!(catch(|| 3).unwrap(), 3);
        // Nested: the inner panic is the inner call's.
        let outer = catch(|| catch(|| -> () { panic!("inner") }).unwrap_err()).unwrap();
        assert!(outer.contains("inner"), "{outer}");
    }
}
