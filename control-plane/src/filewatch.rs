//! Keep state read from files current while the files change in place: the ingest token
//! ([`crate::token`]) and the TLS material ([`crate::tls`]), with no restart or SIGHUP.
//!
//! The files' directories are watched (`notify`): Kubernetes updates a mounted Secret or
//! projected volume by writing a new timestamped directory and swapping the `..data`
//! symlink, so the event names `..data`, not the file; any event in a watched directory
//! therefore checks the files. A check also runs every [`POLL`] in case an event is missed
//! (inotify does not cross some volume types). A check waits 50 ms (a symlink swap or a
//! writer's second file settles), reads every file (regular files of at most
//! [`crate::files::MAX_TLS_BYTES`]: [`crate::files`]) and calls the owner's reload only when
//! some file's bytes (or its readability) differ from the last check, so an unchanged or a
//! still-bad file is neither re-parsed nor re-logged every 30 s. A failed reload keeps the
//! previous state, logs one warning and counts one
//! `kvroute_cp_file_reload_failures_total{source}`; the owner's receivers keep the last good
//! value.

use prometheus_client::metrics::counter::Counter;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Fallback re-check period.
pub const POLL: Duration = Duration::from_secs(30);
/// Wait between an event and the read.
const SETTLE: Duration = Duration::from_millis(50);

/// What a reload did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reloaded {
    /// New state published.
    Changed,
    /// The files changed but the state they give did not (logged at debug).
    Same,
    /// Nobody listens any more: stop watching.
    Stop,
}

/// A running watch; dropping it stops watching (the owner's receivers keep the last value).
pub struct FileWatch {
    _watcher: Option<notify::RecommendedWatcher>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FileWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Each file's bytes, or the error kind that kept it from being read.
type Fingerprint = Vec<Result<Vec<u8>, std::io::ErrorKind>>;

fn fingerprint(paths: &[PathBuf]) -> Fingerprint {
    paths
        .iter()
        .map(|p| crate::files::read_regular(p, crate::files::MAX_TLS_BYTES).map_err(|e| e.kind()))
        .collect()
}

impl FileWatch {
    /// Watch `paths` (the files `source` is built from; `source` names it in logs and in
    /// the metric, e.g. `push.tls`) and call `reload` when they change. `reload` reads the
    /// files itself and publishes the result; `Err(reason)` keeps the previous state and
    /// bumps `failures`. Must run inside a tokio runtime.
    pub fn spawn<F>(
        paths: Vec<PathBuf>,
        source: std::borrow::Cow<'static, str>,
        failures: Counter,
        mut reload: F,
    ) -> Self
    where
        F: FnMut() -> Result<Reloaded, String> + Send + 'static,
    {
        let (ev_tx, mut ev_rx) = tokio::sync::mpsc::channel::<()>(1);
        let watcher = watch_dirs(&paths, &source, ev_tx);
        let mut events_open = watcher.is_some();
        let mut last = fingerprint(&paths);
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    e = ev_rx.recv(), if events_open => if e.is_none() { events_open = false },
                    _ = tokio::time::sleep(POLL) => {}
                }
                tokio::time::sleep(SETTLE).await;
                let now = fingerprint(&paths);
                if now == last {
                    continue;
                }
                last = now;
                match reload() {
                    Ok(Reloaded::Changed) => tracing::info!(%source, "reloaded from changed files"),
                    Ok(Reloaded::Same) => {
                        tracing::debug!(%source, "files changed, content equivalent")
                    }
                    Ok(Reloaded::Stop) => return,
                    Err(reason) => {
                        failures.inc();
                        tracing::warn!(%source, error = %reason, "changed files unusable; keeping the previous ones");
                    }
                }
            }
        });
        Self {
            _watcher: watcher,
            task,
        }
    }
}

fn watch_dirs(
    paths: &[PathBuf],
    source: &str,
    tx: tokio::sync::mpsc::Sender<()>,
) -> Option<notify::RecommendedWatcher> {
    use notify::Watcher;
    let mut dirs: Vec<PathBuf> = paths
        .iter()
        .map(|p| match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        })
        .collect();
    dirs.sort();
    dirs.dedup();
    let mut w = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if ev.is_ok() {
            let _ = tx.try_send(());
        }
    })
    .map_err(
        |e| tracing::warn!(source, error = %e, "cannot watch files; re-reading them every 30 s"),
    )
    .ok()?;
    for d in &dirs {
        w.watch(Path::new(d), notify::RecursiveMode::NonRecursive)
            .map_err(|e| tracing::warn!(source, dir = %d.display(), error = %e, "cannot watch the directory; re-reading its files every 30 s"))
            .ok()?;
    }
    Some(w)
}
