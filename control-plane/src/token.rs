//! The ingest bearer token, kept current without a restart or SIGHUP.
//!
//! With `push.token_file` set, the file's directory is watched (`notify`): Kubernetes
//! updates a mounted Secret or a projected service-account token by writing a new
//! timestamped directory and swapping the `..data` symlink, so the event names `..data`, not
//! the file; any event in the directory therefore re-reads the file. A re-read also runs every
//! [`POLL`] in case an event is missed (inotify does not cross some volume types). A read that
//! fails or yields an unusable token keeps the previous token and logs a warning; pushes go on
//! with it. Projected tokens rotate at 80 % of their lifetime
//! (<https://kubernetes.io/docs/concepts/storage/projected-volumes/#serviceaccounttoken>), so
//! the old token is still valid while the new one is picked up.

use crate::config::{ConfigError, PushSettings};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Fallback re-read period of the token file.
pub const POLL: Duration = Duration::from_secs(30);

/// The current token (`None`: push without `Authorization`).
pub type TokenRx = watch::Receiver<Option<Arc<str>>>;

/// A running token source; dropping it stops watching (the receivers keep the last value).
pub struct TokenSource {
    rx: TokenRx,
    _watcher: Option<notify::RecommendedWatcher>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for TokenSource {
    fn drop(&mut self) {
        if let Some(t) = self.task.take() {
            t.abort();
        }
    }
}

impl TokenSource {
    /// Read the token now (errors as [`PushSettings::read_token`]) and, for a token file,
    /// keep it current.
    pub fn start(settings: &PushSettings) -> Result<Self, ConfigError> {
        let first = settings.read_token()?.map(Arc::<str>::from);
        let (tx, rx) = watch::channel(first);
        let Some(path) = settings.token_file.clone() else {
            return Ok(Self {
                rx,
                _watcher: None,
                task: None,
            });
        };
        let (ev_tx, mut ev_rx) = tokio::sync::mpsc::channel::<()>(1);
        let watcher = watch_dir(&path, ev_tx);
        let settings = settings.clone();
        let mut events_open = watcher.is_some();
        let task = tokio::spawn(async move {
            loop {
                tokio::select! {
                    e = ev_rx.recv(), if events_open => if e.is_none() { events_open = false },
                    _ = tokio::time::sleep(POLL) => {}
                }
                if tx.is_closed() {
                    return;
                }
                // Let a symlink swap finish before reading.
                tokio::time::sleep(Duration::from_millis(50)).await;
                match settings.read_token() {
                    Ok(t) => {
                        let t = t.map(Arc::<str>::from);
                        tx.send_if_modified(|cur| {
                            if *cur == t {
                                false
                            } else {
                                tracing::info!(file = %path.display(), "ingest token reloaded");
                                *cur = t;
                                true
                            }
                        });
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "token file unreadable; keeping the previous token")
                    }
                }
            }
        });
        Ok(Self {
            rx,
            _watcher: watcher,
            task: Some(task),
        })
    }

    /// A receiver of the current token.
    pub fn subscribe(&self) -> TokenRx {
        self.rx.clone()
    }
}

fn watch_dir(
    path: &std::path::Path,
    tx: tokio::sync::mpsc::Sender<()>,
) -> Option<notify::RecommendedWatcher> {
    use notify::Watcher;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut w = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if ev.is_ok() {
            let _ = tx.try_send(());
        }
    })
    .map_err(
        |e| tracing::warn!(error = %e, "cannot watch the token file; re-reading it every 30 s"),
    )
    .ok()?;
    w.watch(&dir, notify::RecursiveMode::NonRecursive)
        .map_err(|e| tracing::warn!(error = %e, "cannot watch the token directory; re-reading it every 30 s"))
        .ok()?;
    Some(w)
}
