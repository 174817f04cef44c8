//! TLS for scrapes and pushes (rustls with the ring provider, through hyper-rustls).
//!
//! One [`rustls::ClientConfig`] per direction, built when the config is loaded and rebuilt
//! when its files change on disk ([`TlsSource`]):
//! - roots: `ca_file` (PEM bundle; every certificate in it is trusted), else the system's
//!   trust store (rustls-native-certs);
//! - optional client certificate for mTLS: `cert_file` (PEM chain, leaf first) and
//!   `key_file` (PEM PKCS#8, PKCS#1 or SEC1 key), both or neither;
//! - TLS 1.2 and 1.3; ALPN `http/1.1`.
//!
//! cert-manager and kubelet update a mounted Secret in place (a `..data` symlink swap). The
//! files' directories are watched ([`crate::filewatch`]); on a change the config is rebuilt
//! from all three files and published on a watch channel. [`Connector`] reads the channel
//! for every new connection, so the next connection uses the new CA bundle and client
//! certificate; connections already open (keep-alive) finish with the material they were
//! made with, and the new config starts a fresh TLS session cache, so no session resumed
//! under the old material skips the new checks. Files that change into something unusable
//! (a cert and key that do not match, a bundle with no certificate, a missing file) keep the
//! previous config, log one warning and count one
//! `kvroute_cp_file_reload_failures_total{source="scrape.tls"|"push.tls"}`.
//!
//! The connector speaks plain HTTP for `http://` URLs and TLS for `https://` ones, so one
//! client serves both. The server name checked is the URL's host; for pods reached by IP
//! (Kubernetes discovery) the certificate must carry that IP as a SAN, or use a CA bundle
//! whose certificates name it.

use crate::config::TlsSettings;
use crate::filewatch::{FileWatch, Reloaded};
use hyper_util::client::legacy::connect::HttpConnector;
use prometheus_client::metrics::counter::Counter;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::watch;

/// The current client config of one direction.
pub type TlsRx = watch::Receiver<Arc<rustls::ClientConfig>>;

/// Why a TLS configuration could not be built.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or parsed.
    #[error("{field} `{path}`: {reason}")]
    File {
        /// Config field (`scrape.tls.ca_file`, ...).
        field: String,
        /// Path.
        path: String,
        /// What went wrong.
        reason: String,
    },
    /// rustls refused the combination (e.g. key does not match the certificate).
    #[error("{field}: {reason}")]
    Rustls {
        /// Config section (`scrape.tls`, ...).
        field: String,
        /// rustls' message.
        reason: String,
    },
}

fn file_err(field: &str, path: &std::path::Path, reason: impl ToString) -> TlsError {
    TlsError::File {
        field: field.into(),
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

/// A TLS file's bytes: a regular file of at most [`crate::files::MAX_TLS_BYTES`].
fn read(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    crate::files::read_regular(path, crate::files::MAX_TLS_BYTES)
}

/// Build the client config for `section` (`scrape.tls` or `push.tls`, used in errors).
pub fn client_config(
    section: &str,
    s: &TlsSettings,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    match &s.ca_file {
        Some(path) => {
            let field = format!("{section}.ca_file");
            let bytes = read(path).map_err(|e| file_err(&field, path, e))?;
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&bytes)
                .collect::<Result<_, _>>()
                .map_err(|e| file_err(&field, path, e))?;
            if certs.is_empty() {
                return Err(file_err(&field, path, "no PEM certificate in the file"));
            }
            for c in certs {
                roots.add(c).map_err(|e| file_err(&field, path, e))?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            for e in &native.errors {
                tracing::warn!(error = %e, "system trust store partly unreadable");
            }
            let (added, _) = roots.add_parsable_certificates(native.certs);
            if added == 0 {
                tracing::debug!(section, "no system CA certificates; https:// needs ca_file");
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .map_err(|e| TlsError::Rustls {
            field: section.into(),
            reason: e.to_string(),
        })?
        .with_root_certificates(roots);
    let mut config = match (&s.cert_file, &s.key_file) {
        (Some(cert), Some(key)) => {
            let cf = format!("{section}.cert_file");
            let bytes = read(cert).map_err(|e| file_err(&cf, cert, e))?;
            let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&bytes)
                .collect::<Result<_, _>>()
                .map_err(|e| file_err(&cf, cert, e))?;
            if chain.is_empty() {
                return Err(file_err(&cf, cert, "no PEM certificate in the file"));
            }
            let kf = format!("{section}.key_file");
            let bytes = read(key).map_err(|e| file_err(&kf, key, e))?;
            let key_der =
                PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| file_err(&kf, key, e))?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| TlsError::Rustls {
                    field: section.into(),
                    reason: e.to_string(),
                })?
        }
        _ => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// The client config of one direction, kept current while its files change.
pub struct TlsSource {
    rx: TlsRx,
    _watch: Option<FileWatch>,
}

impl TlsSource {
    /// Build the config now (errors as [`client_config`]) and, when any file is set, rebuild
    /// it when the files change; rebuilds that fail count in `failures`. Must run inside a
    /// tokio runtime.
    pub fn start(
        section: &'static str,
        settings: &TlsSettings,
        failures: Counter,
    ) -> Result<Self, TlsError> {
        let (tx, rx) = watch::channel(client_config(section, settings)?);
        let files: Vec<_> = [&settings.ca_file, &settings.cert_file, &settings.key_file]
            .into_iter()
            .flatten()
            .cloned()
            .collect();
        if files.is_empty() {
            return Ok(Self { rx, _watch: None });
        }
        let settings = settings.clone();
        let watch = FileWatch::spawn(files, section.into(), failures, move || {
            if tx.is_closed() {
                return Ok(Reloaded::Stop);
            }
            let config = client_config(section, &settings).map_err(|e| e.to_string())?;
            tx.send_replace(config);
            Ok(Reloaded::Changed)
        });
        Ok(Self {
            rx,
            _watch: Some(watch),
        })
    }

    /// A receiver of the current config.
    pub fn subscribe(&self) -> TlsRx {
        self.rx.clone()
    }
}

/// Connector for `http://` and `https://` URLs: TCP with the settings of [`connector`], TLS
/// with the config current when the connection is made.
#[derive(Clone)]
pub struct Connector {
    http: HttpConnector,
    tls: TlsRx,
}

impl tower_service::Service<http::Uri> for Connector {
    type Response = <hyper_rustls::HttpsConnector<HttpConnector> as tower_service::Service<
        http::Uri,
    >>::Response;
    type Error =
        <hyper_rustls::HttpsConnector<HttpConnector> as tower_service::Service<http::Uri>>::Error;
    type Future =
        <hyper_rustls::HttpsConnector<HttpConnector> as tower_service::Service<http::Uri>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        tower_service::Service::<http::Uri>::poll_ready(&mut self.http, cx).map_err(Into::into)
    }

    fn call(&mut self, dst: http::Uri) -> Self::Future {
        let tls = self.tls.borrow().clone();
        // `From<(connector, config)>`: plain HTTP for `http://`, TLS for `https://`, the
        // URL's host as the server name, the config's ALPN as is.
        let mut https = hyper_rustls::HttpsConnector::from((self.http.clone(), tls));
        https.call(dst)
    }
}

/// A connector with `TCP_NODELAY` and a connect timeout, TLS per the current value of `tls`.
pub fn connector(connect_timeout: Duration, tls: &TlsRx) -> Connector {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    // hyper-rustls refuses `https://` on a connector that enforces `http://` only.
    http.enforce_http(false);
    Connector {
        http,
        tls: tls.clone(),
    }
}
