//! Ctrl-C / SIGTERM as one future, for racing against the demo with `tokio::select!`.

/// Resolves on the first SIGINT (Ctrl-C) or SIGTERM, with the signal's name. If a handler
/// cannot be installed, that signal is simply not awaited (the other still is).
pub async fn shutdown_signal() -> &'static str {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => "SIGINT",
        _ = term => "SIGTERM",
    }
}
