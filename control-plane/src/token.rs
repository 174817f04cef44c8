//! The ingest bearer token, kept current without a restart or SIGHUP.
//!
//! With `push.token_file` set, the file is watched by [`crate::filewatch`] (directory events
//! from a Secret or projected-volume update, a re-check every 30 s). A read that fails or
//! yields an unusable token keeps the previous token, logs a warning and counts one
//! `kvroute_cp_file_reload_failures_total{source="push.token_file"}`; pushes go on with it.
//! Projected tokens rotate at 80 % of their lifetime
//! (<https://kubernetes.io/docs/concepts/storage/projected-volumes/#serviceaccounttoken>), so
//! the old token is still valid while the new one is picked up.

use crate::config::{ConfigError, PushSettings};
use crate::filewatch::{FileWatch, Reloaded};
use prometheus_client::metrics::counter::Counter;
use std::sync::Arc;
use tokio::sync::watch;

/// The current token (`None`: push without `Authorization`).
pub type TokenRx = watch::Receiver<Option<Arc<str>>>;

/// A running token source; dropping it stops watching (the receivers keep the last value).
pub struct TokenSource {
    rx: TokenRx,
    _watch: Option<FileWatch>,
}

impl TokenSource {
    /// Read the token now (errors as [`PushSettings::read_token`]) and, for a token file,
    /// keep it current; failed re-reads count in `failures`. Must run inside a tokio runtime.
    pub fn start(settings: &PushSettings, failures: Counter) -> Result<Self, ConfigError> {
        let first = settings.read_token()?.map(Arc::<str>::from);
        let (tx, rx) = watch::channel(first);
        let Some(path) = settings.token_file.clone() else {
            return Ok(Self { rx, _watch: None });
        };
        let settings = settings.clone();
        let watch = FileWatch::spawn(vec![path], "push.token_file", failures, move || {
            if tx.is_closed() {
                return Ok(Reloaded::Stop);
            }
            let t = settings
                .read_token()
                .map_err(|e| e.to_string())?
                .map(Arc::<str>::from);
            Ok(
                if tx.send_if_modified(|cur| {
                    let changed = *cur != t;
                    if changed {
                        *cur = t;
                    }
                    changed
                }) {
                    Reloaded::Changed
                } else {
                    Reloaded::Same
                },
            )
        });
        Ok(Self {
            rx,
            _watch: Some(watch),
        })
    }

    /// A receiver of the current token.
    pub fn subscribe(&self) -> TokenRx {
        self.rx.clone()
    }
}
