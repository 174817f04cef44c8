//! TLS for scrapes and pushes (rustls with the ring provider, through hyper-rustls).
//!
//! One [`rustls::ClientConfig`] per direction, built when the config is loaded:
//! - roots: `ca_file` (PEM bundle; every certificate in it is trusted), else the system's
//!   trust store (rustls-native-certs);
//! - optional client certificate for mTLS: `cert_file` (PEM chain, leaf first) and
//!   `key_file` (PEM PKCS#8, PKCS#1 or SEC1 key), both or neither;
//! - TLS 1.2 and 1.3; ALPN `http/1.1` (set by hyper-rustls, which refuses a preset list).
//!
//! The connector speaks plain HTTP for `http://` URLs and TLS for `https://` ones, so one
//! client serves both. The server name checked is the URL's host; for pods reached by IP
//! (Kubernetes discovery) the certificate must carry that IP as a SAN, or use a CA bundle
//! whose certificates name it.

use crate::config::TlsSettings;
use hyper_util::client::legacy::connect::HttpConnector;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::sync::Arc;
use std::time::Duration;

/// Connector for `http://` and `https://` URLs.
pub type Connector = hyper_rustls::HttpsConnector<HttpConnector>;

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

/// Build the client config for `section` (`scrape.tls` or `push.tls`, used in errors).
pub fn client_config(
    section: &str,
    s: &TlsSettings,
) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    match &s.ca_file {
        Some(path) => {
            let field = format!("{section}.ca_file");
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
                .map_err(|e| file_err(&field, path, e))?
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
    let config = match (&s.cert_file, &s.key_file) {
        (Some(cert), Some(key)) => {
            let cf = format!("{section}.cert_file");
            let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
                .map_err(|e| file_err(&cf, cert, e))?
                .collect::<Result<_, _>>()
                .map_err(|e| file_err(&cf, cert, e))?;
            if chain.is_empty() {
                return Err(file_err(&cf, cert, "no PEM certificate in the file"));
            }
            let key_der = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| file_err(&format!("{section}.key_file"), key, e))?;
            builder
                .with_client_auth_cert(chain, key_der)
                .map_err(|e| TlsError::Rustls {
                    field: section.into(),
                    reason: e.to_string(),
                })?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

/// A connector with `TCP_NODELAY` and a connect timeout, TLS per `tls`.
pub fn connector(connect_timeout: Duration, tls: &rustls::ClientConfig) -> Connector {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_connect_timeout(Some(connect_timeout));
    // hyper-rustls refuses `https://` on a connector that enforces `http://` only.
    conn.enforce_http(false);
    hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls.clone())
        .https_or_http()
        .enable_http1()
        .wrap_connector(conn)
}
