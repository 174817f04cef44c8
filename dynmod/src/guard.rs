//! The panic barrier: Envoy must never die because of kvroute.
//!
//! The module is built with the `dynmod` cargo profile (`panic = "unwind"`; the workspace's
//! release profile aborts), so a panic in kvroute's code unwinds to the exported hook, which
//! runs its work inside [`fail_open`]: the panic is caught, logged once per process at
//! critical level (every panic still goes to Envoy's stderr through Rust's panic hook), and
//! the hook answers its fallback: "continue" for a stream hook, so the request goes on
//! unrouted (Envoy's default route), as the Wasm filter's `failure_policy: FAIL_OPEN` does.
//! Unwinding across the C boundary would be undefined behaviour; it never gets that far.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};

static LOGGED: AtomicBool = AtomicBool::new(false);

/// Run `f`; on a panic, log (the first time) and return `fallback`. `Err(())` from
/// [`catch`] tells a caller that wants to know.
pub fn fail_open<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch(f).unwrap_or(fallback)
}

/// Run `f`; `Err(())` when it panicked (logged the first time).
pub fn catch<T>(f: impl FnOnce() -> T) -> Result<T, ()> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        if !LOGGED.swap(true, Ordering::Relaxed) {
            let what = p
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            crate::abi::log(
                crate::abi::LogLevel::Critical,
                &format!("kvroute: panic caught, request continues unrouted (logged once): {what}"),
            );
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::panic)] // The point of the test.
    fn a_panic_becomes_the_fallback_and_the_next_call_works() {
        assert_eq!(fail_open(7u32, || panic!("deliberate")), 7);
        assert!(LOGGED.load(Ordering::Relaxed));
        assert_eq!(fail_open(7u32, || 1), 1);
        let v: Vec<u8> = Vec::new();
        assert_eq!(
            fail_open(0usize, || v
                .get(3)
                .copied()
                .map_or_else(|| panic!("oob"), usize::from)),
            0
        );
    }
}
