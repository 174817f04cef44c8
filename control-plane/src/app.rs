//! Wiring: starts the HTTP server, the snapshot builder, and a supervisor that keeps one
//! scrape task per discovered endpoint and one push task per target, restarting them when
//! discovery or the config changes.

use crate::config::{Config, ConfigError, EndpointSpec, PushSettings, ScrapeSettings, Target};
use crate::discovery::{Discovery, StaticDiscovery};
use crate::hub::Hub;
use crate::{push, scrape, server};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// Why the control plane could not start or reload.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// Own listen address unavailable.
    #[error("cannot listen on {addr}: {reason}")]
    Bind {
        /// Address.
        addr: SocketAddr,
        /// OS error.
        reason: String,
    },
    /// Config problem (token file unreadable, ...).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The supervisor is gone (shutting down).
    #[error("control plane is shutting down")]
    Stopped,
}

struct Settings {
    scrape: ScrapeSettings,
    push: PushSettings,
    targets: Vec<Target>,
    token: Option<Arc<str>>,
    token_source: Arc<str>,
}

/// A running control plane.
pub struct ControlPlane {
    hub: Arc<Hub>,
    local_addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    reload: mpsc::Sender<(Config, Option<Arc<str>>)>,
    discovery: Arc<StaticDiscovery>,
    tasks: Vec<JoinHandle<()>>,
}

fn first_wait(c: &Config) -> std::time::Duration {
    c.scrape.timeout + c.scrape.interval
}

impl ControlPlane {
    /// Start everything on the current tokio runtime.
    pub async fn start(config: Config) -> Result<Self, StartError> {
        let token = config.push.read_token()?.map(Arc::<str>::from);
        if token.is_none() && !config.targets.is_empty() {
            tracing::warn!(
                source = %config.push.token_source(),
                "no ingest token found; pushing without Authorization (a filter with an `ingest_token` answers 401)"
            );
        }
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .map_err(|e| StartError::Bind {
                addr: config.listen,
                reason: e.to_string(),
            })?;
        let local_addr = listener.local_addr().map_err(|e| StartError::Bind {
            addr: config.listen,
            reason: e.to_string(),
        })?;
        let hub = Hub::new(
            config.push.heartbeat,
            config.push.min_interval,
            first_wait(&config),
        );
        hub.set_endpoints(&config.endpoints);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let discovery = Arc::new(StaticDiscovery::new(config.endpoints.clone()));
        let (reload, reload_rx) = mpsc::channel(4);
        let settings = Settings {
            scrape: config.scrape.clone(),
            push: config.push.clone(),
            targets: config.targets.clone(),
            token,
            token_source: config.push.token_source().into(),
        };
        let tasks = vec![
            tokio::spawn(server::serve(listener, hub.clone(), shutdown_rx.clone())),
            tokio::spawn(hub.clone().run_builder(shutdown_rx.clone())),
            tokio::spawn(supervise(
                hub.clone(),
                discovery.clone(),
                settings,
                reload_rx,
                shutdown_rx,
            )),
        ];
        tracing::info!(%local_addr, endpoints = config.endpoints.len(), targets = config.targets.len(), "kvroute-cp started");
        Ok(Self {
            hub,
            local_addr,
            shutdown,
            reload,
            discovery,
            tasks,
        })
    }

    /// Address of the own HTTP server.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Shared state (tests, benchmarks).
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// Apply a new config (endpoints, scrape/push settings, targets, token). The listen
    /// address is not changed (needs a restart). Errors leave the running config in place.
    pub async fn reload(&self, config: Config) -> Result<(), StartError> {
        let token = config.push.read_token()?.map(Arc::<str>::from);
        self.hub.set_timing(
            config.push.heartbeat,
            config.push.min_interval,
            first_wait(&config),
        );
        self.hub.set_endpoints(&config.endpoints);
        self.discovery.set(config.endpoints.clone());
        self.reload
            .send((config, token))
            .await
            .map_err(|_| StartError::Stopped)
    }

    /// Stop every task and wait for them.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

async fn supervise(
    hub: Arc<Hub>,
    discovery: Arc<StaticDiscovery>,
    mut settings: Settings,
    mut reload: mpsc::Receiver<(Config, Option<Arc<str>>)>,
    mut shutdown: watch::Receiver<bool>,
) {
    let scrape_client = scrape::client(scrape::connect_timeout(settings.scrape.timeout));
    let push_client = push::client(settings.push.timeout);
    let mut endpoints_rx = discovery.subscribe();
    let mut scrapers: BTreeMap<String, (EndpointSpec, watch::Sender<bool>, JoinHandle<()>)> =
        BTreeMap::new();
    let mut pushers: Vec<(watch::Sender<bool>, JoinHandle<()>)> = Vec::new();
    let mut restart_scrapers = false;
    let mut restart_pushers = true;
    loop {
        let specs = endpoints_rx.borrow_and_update().clone();
        hub.set_endpoints(&specs);
        // Stop tasks whose endpoint is gone or changed (or all, on a settings change).
        scrapers.retain(|id, (spec, stop, _)| {
            let keep = !restart_scrapers && specs.iter().any(|s| &s.id == id && s == spec);
            if !keep {
                let _ = stop.send(true);
            }
            keep
        });
        for spec in specs.iter() {
            if !scrapers.contains_key(&spec.id) {
                let (stop, stop_rx) = watch::channel(false);
                let task = tokio::spawn(scrape::run_endpoint(
                    hub.clone(),
                    scrape_client.clone(),
                    spec.clone(),
                    settings.scrape.clone(),
                    stop_rx,
                ));
                scrapers.insert(spec.id.clone(), (spec.clone(), stop, task));
            }
        }
        if restart_pushers {
            for (stop, _) in pushers.drain(..) {
                let _ = stop.send(true);
            }
            for t in &settings.targets {
                let (stop, stop_rx) = watch::channel(false);
                let task = tokio::spawn(push::run_target(
                    hub.clone(),
                    push_client.clone(),
                    t.clone(),
                    settings.push.clone(),
                    settings.token.clone(),
                    settings.token_source.clone(),
                    stop_rx,
                ));
                pushers.push((stop, task));
            }
        }
        restart_scrapers = false;
        restart_pushers = false;
        tokio::select! {
            r = endpoints_rx.changed() => if r.is_err() { break },
            msg = reload.recv() => match msg {
                Some((config, token)) => {
                    restart_scrapers = config.scrape != settings.scrape;
                    restart_pushers = config.push != settings.push
                        || config.targets != settings.targets
                        || token != settings.token;
                    let names: Vec<&str> = config.targets.iter().map(|t| t.name.as_str()).collect();
                    hub.retain_push_targets(&names);
                    settings = Settings {
                        token_source: config.push.token_source().into(),
                        scrape: config.scrape,
                        push: config.push,
                        targets: config.targets,
                        token,
                    };
                    tracing::info!(restart_scrapers, restart_pushers, "config reloaded");
                }
                None => break,
            },
            _ = shutdown.changed() => break,
        }
    }
    for (_, (_, stop, task)) in scrapers {
        let _ = stop.send(true);
        task.abort();
    }
    for (stop, task) in pushers {
        let _ = stop.send(true);
        task.abort();
    }
}
