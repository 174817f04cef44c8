//! Bearer tokens, kept current without a restart or SIGHUP: the ingest token of the pushes
//! (`push.token_file` / `push.token_env`) and the model servers' API keys of the scrapes
//! (`scrape.token_file` / `scrape.token_env`, and a pool's own `scrape_token_file` /
//! `scrape_token_env`), all read by [`TokenSettings::read`].
//!
//! With a token file set, the file is watched by [`crate::filewatch`] (directory events
//! from a Secret or projected-volume update, a re-check every 30 s). A read that fails or
//! yields an unusable token keeps the previous token, logs a warning and counts one
//! `kvroute_cp_file_reload_failures_total{source}` (`source="push.token_file"`,
//! `"scrape.token_file"` or a pool's `"pools[0].scrape_token_file"`); pushes and scrapes go
//! on with it. Each request reads the current
//! token from the [`TokenRx`], so a rotated file applies to the next request.
//! Projected tokens rotate at 80 % of their lifetime
//! (<https://kubernetes.io/docs/concepts/storage/projected-volumes/#serviceaccounttoken>), so
//! the old token is still valid while the new one is picked up.

use crate::config::{ConfigError, TokenSettings};
use crate::filewatch::{FileWatch, Reloaded};
use prometheus_client::metrics::counter::Counter;
use std::sync::Arc;
use tokio::sync::watch;

/// The current token (`None`: requests go without `Authorization`).
pub type TokenRx = watch::Receiver<Option<Arc<str>>>;

/// A running token source; dropping it stops watching (the receivers keep the last value).
pub struct TokenSource {
    rx: TokenRx,
    _watch: Option<FileWatch>,
}

impl TokenSource {
    /// Read the token now (errors as [`TokenSettings::read`]) and, for a token file,
    /// keep it current; failed re-reads count in `failures` (the counter of `source`
    /// [`crate::config::TokenFor::file_field`]). Must run inside a tokio runtime.
    pub fn start(settings: &TokenSettings, failures: Counter) -> Result<Self, ConfigError> {
        let first = settings.read()?.map(Arc::<str>::from);
        let (tx, rx) = watch::channel(first);
        let Some(path) = settings.file.clone() else {
            return Ok(Self { rx, _watch: None });
        };
        let settings = settings.clone();
        let source = settings.section.file_field();
        let watch = FileWatch::spawn(vec![path], source, failures, move || {
            if tx.is_closed() {
                return Ok(Reloaded::Stop);
            }
            let t = settings
                .read()
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

/// The `Authorization` header value for `token`: `Bearer <token>`
/// ([`kvroute_core::snapshot::AUTH_SCHEME`]), as pushes and scrapes send it.
pub fn bearer(token: &str) -> String {
    format!("{}{token}", kvroute_core::snapshot::AUTH_SCHEME)
}
