//! Wiring: starts the HTTP server, the snapshot builder, and a supervisor that keeps one
//! scrape task per discovered endpoint and one push task per target (static or discovered
//! gateway pod), starting and stopping them as discovery or the config changes, plus the
//! Kubernetes watch tasks ([`crate::discovery`]).

use crate::config::{
    Config, ConfigError, EndpointSpec, KubernetesSettings, PushSettings, ScrapeSettings, Target,
    TokenSettings,
};
use crate::discovery::{gateways, kubernetes, Merged, STATIC_SLOT};
use crate::hub::Hub;
use crate::telemetry::Telemetry;
use crate::tls::TlsSource;
use crate::token::{TokenRx, TokenSource};
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
    /// No usable Kubernetes client (no in-cluster config or kubeconfig, bad `api_server`).
    #[error("kubernetes: {reason}")]
    Kubernetes {
        /// What kube-rs reported.
        reason: String,
    },
    /// A TLS file is unreadable or unusable.
    #[error("tls: {0}")]
    Tls(#[from] crate::tls::TlsError),
    /// The supervisor is gone (shutting down).
    #[error("control plane is shutting down")]
    Stopped,
}

struct Settings {
    scrape: ScrapeSettings,
    push: PushSettings,
    kubernetes: KubernetesSettings,
    /// The current ingest token.
    token: TokenRx,
    /// Where the ingest token comes from (file or env var), named in 401 logs.
    token_source: Arc<str>,
    /// The current scrape tokens.
    scrape_token: ScrapeTokens,
    kube: Option<kube::Client>,
    tls: Tls,
}

/// The TLS client configs of both directions, each kept current while its files change.
struct Tls {
    scrape: TlsSource,
    push: TlsSource,
}

impl Tls {
    fn build(c: &Config, t: &Telemetry) -> Result<Self, StartError> {
        const SCRAPE: &str = "scrape.tls";
        const PUSH: &str = "push.tls";
        Ok(Self {
            scrape: TlsSource::start(SCRAPE, &c.scrape.tls, t.file_reload_failures(SCRAPE))?,
            push: TlsSource::start(PUSH, &c.push.tls, t.file_reload_failures(PUSH))?,
        })
    }
}

fn start_token(s: &TokenSettings, t: &Telemetry) -> Result<TokenSource, ConfigError> {
    TokenSource::start(s, t.file_reload_failures(&s.section.file_field()))
}

/// The token sources of both directions; dropping one stops watching its file.
struct Tokens {
    push: TokenSource,
    scrape: TokenSource,
    /// Pools with their own scrape token, by pool name.
    pools: BTreeMap<String, TokenSource>,
}

impl Tokens {
    fn start(c: &Config, t: &Telemetry) -> Result<Self, ConfigError> {
        let mut pools = BTreeMap::new();
        for (name, s) in &c.scrape.pool_tokens {
            pools.insert(name.clone(), start_token(s, t)?);
        }
        Ok(Self {
            push: start_token(&c.push.token(), t)?,
            scrape: start_token(&c.scrape.token(), t)?,
            pools,
        })
    }

    fn scrape_tokens(&self) -> ScrapeTokens {
        ScrapeTokens {
            default: self.scrape.subscribe(),
            pools: self
                .pools
                .iter()
                .map(|(name, s)| (name.clone(), s.subscribe()))
                .collect(),
        }
    }
}

/// The current scrape tokens: `scrape.token_*`'s and each pool's own.
#[derive(Clone)]
struct ScrapeTokens {
    default: TokenRx,
    pools: BTreeMap<String, TokenRx>,
}

impl ScrapeTokens {
    /// The token of `pool`'s endpoints: its own, else `scrape.token_*`'s.
    fn for_pool(&self, pool: &str) -> TokenRx {
        self.pools.get(pool).unwrap_or(&self.default).clone()
    }

    /// Every token's current value, to tell when one changed under the same settings (a
    /// token from an environment variable).
    fn values(&self) -> Vec<Option<Arc<str>>> {
        std::iter::once(&self.default)
            .chain(self.pools.values())
            .map(|rx| rx.borrow().clone())
            .collect()
    }
}

/// One reload's worth of new state, built before it is applied.
struct Reload {
    config: Config,
    tokens: Tokens,
    kube: Option<kube::Client>,
    tls: Tls,
}

/// A running control plane.
pub struct ControlPlane {
    hub: Arc<Hub>,
    local_addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    reload: mpsc::Sender<Reload>,
    endpoints: Arc<Merged<EndpointSpec>>,
    targets: Arc<Merged<Target>>,
    tasks: Vec<JoinHandle<()>>,
}

fn first_wait(c: &Config) -> std::time::Duration {
    c.scrape.timeout + c.scrape.interval
}

/// A Kubernetes client for `k`, or `None` when nothing is watched. `api_server` wins; else
/// kube-rs infers in-cluster config, then kubeconfig.
async fn kube_client(k: &KubernetesSettings) -> Result<Option<kube::Client>, StartError> {
    if k.is_empty() {
        return Ok(None);
    }
    let config = match &k.api_server {
        Some(uri) => kube::Config::new(uri.clone()),
        None => kube::Config::infer()
            .await
            .map_err(|e| StartError::Kubernetes {
                reason: e.to_string(),
            })?,
    };
    kube::client::ClientBuilder::try_from(config)
        .map(|b| {
            Some(
                b.with_layer(&crate::discovery::api_guard::ApiGuardLayer::default())
                    .build(),
            )
        })
        .map_err(|e| StartError::Kubernetes {
            reason: e.to_string(),
        })
}

impl ControlPlane {
    /// Start everything on the current tokio runtime.
    pub async fn start(config: Config) -> Result<Self, StartError> {
        let hub = Hub::new(
            config.push.heartbeat,
            config.push.min_interval,
            first_wait(&config),
        );
        let tls = Tls::build(&config, &hub.telemetry)?;
        let tokens = Tokens::start(&config, &hub.telemetry)?;
        if tokens.push.subscribe().borrow().is_none()
            && !(config.targets.is_empty() && config.kubernetes.gateways.is_empty())
        {
            tracing::warn!(
                source = %config.push.token_source(),
                "no ingest token found; pushing without Authorization (a filter with an `ingest_token` answers 401)"
            );
        }
        warn_no_scrape_token(&config.scrape, &tokens.scrape, &tokens.pools);
        let kube = kube_client(&config.kubernetes).await?;
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
        // Endpoints first: the pools' models are then judged against them once (the other
        // order logged every configured model as unavailable, then none, at each start).
        hub.set_endpoints(&config.endpoints);
        hub.set_pools(&config.pool_models);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let endpoints = Arc::new(Merged::new(|e: &EndpointSpec| e.id.as_str()));
        endpoints.set(STATIC_SLOT, config.endpoints.clone());
        let targets = Arc::new(Merged::new(|t: &Target| t.name.as_str()));
        targets.set(STATIC_SLOT, config.targets.clone());
        let (reload, reload_rx) = mpsc::channel(4);
        let settings = Settings {
            scrape: config.scrape.clone(),
            push: config.push.clone(),
            kubernetes: config.kubernetes.clone(),
            token: tokens.push.subscribe(),
            token_source: config.push.token_source().into(),
            scrape_token: tokens.scrape_tokens(),
            kube,
            tls,
        };
        let tasks = vec![
            tokio::spawn(server::serve(listener, hub.clone(), shutdown_rx.clone())),
            tokio::spawn(hub.clone().run_builder(shutdown_rx.clone())),
            tokio::spawn(supervise(
                hub.clone(),
                endpoints.clone(),
                targets.clone(),
                settings,
                tokens,
                reload_rx,
                shutdown_rx,
            )),
        ];
        tracing::info!(%local_addr, endpoints = config.endpoints.len(), targets = config.targets.len(),
            inference_pools = config.kubernetes.pools.len(), gateway_sets = config.kubernetes.gateways.len(),
            "kvroute-cp started");
        Ok(Self {
            hub,
            local_addr,
            shutdown,
            reload,
            endpoints,
            targets,
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

    /// The current endpoint set (static and discovered).
    pub fn endpoints(&self) -> Arc<Vec<EndpointSpec>> {
        self.endpoints.current()
    }

    /// The current push targets (static and discovered gateway pods).
    pub fn targets(&self) -> Arc<Vec<Target>> {
        self.targets.current()
    }

    /// Apply a new config (endpoints, scrape/push settings, targets, token, Kubernetes
    /// watches). The listen address is not changed (needs a restart). Errors leave the
    /// running config in place.
    pub async fn reload(&self, config: Config) -> Result<(), StartError> {
        let tls = Tls::build(&config, &self.hub.telemetry)?;
        let tokens = Tokens::start(&config, &self.hub.telemetry)?;
        let kube = kube_client(&config.kubernetes).await?;
        self.hub.set_timing(
            config.push.heartbeat,
            config.push.min_interval,
            first_wait(&config),
        );
        self.hub.set_pools(&config.pool_models);
        self.endpoints.set(STATIC_SLOT, config.endpoints.clone());
        self.targets.set(STATIC_SLOT, config.targets.clone());
        self.reload
            .send(Reload {
                config,
                tokens,
                kube,
                tls,
            })
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

/// Warn when scrape token settings (`scrape.token_*`, or a pool's own) are given but hold
/// no token (an unset or blank variable): servers that want a key answer every scrape 401.
/// Names the source, never a token.
fn warn_no_scrape_token(
    s: &ScrapeSettings,
    default: &TokenSource,
    pools: &BTreeMap<String, TokenSource>,
) {
    let own = s
        .pool_tokens
        .iter()
        .filter_map(|(name, t)| Some((t.clone(), pools.get(name)?)));
    for (settings, source) in std::iter::once((s.token(), default)).chain(own) {
        if let (Some(from), None) = (settings.source(), source.subscribe().borrow().as_ref()) {
            tracing::warn!(
                source = %from,
                "no scrape token found; scraping without Authorization (a server started with an API key answers 401)"
            );
        }
    }
}

type Stoppable = (watch::Sender<bool>, JoinHandle<()>);

/// Start the Kubernetes watch tasks of `s` (none without a client).
fn start_watches(
    s: &Settings,
    scrape_client: &scrape::ScrapeClient,
    endpoints: &Arc<Merged<EndpointSpec>>,
    targets: &Arc<Merged<Target>>,
) -> Vec<Stoppable> {
    let Some(client) = &s.kube else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for p in &s.kubernetes.pools {
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(kubernetes::run_pool(
            client.clone(),
            p.clone(),
            scrape_client.clone(),
            s.scrape_token.for_pool(&p.name),
            endpoints.clone(),
            stop_rx,
        ));
        out.push((stop, task));
    }
    for g in &s.kubernetes.gateways {
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(gateways::run(
            client.clone(),
            g.clone(),
            targets.clone(),
            stop_rx,
        ));
        out.push((stop, task));
    }
    out
}

fn stop_all(tasks: &mut Vec<Stoppable>) {
    for (stop, task) in tasks.drain(..) {
        let _ = stop.send(true);
        task.abort();
    }
}

/// Stop the push tasks of `stopped` (target name, stop sender, task) and forget their
/// gateway reports, then what the targets no longer among `configured` left behind: their
/// per-target series and any ingest-token rejection (`/readyz`).
///
/// Each task is told to stop, aborted and awaited before anything is forgotten: a push
/// still in flight (a slow ingest that then answers 401) would otherwise record its
/// outcome after the forgetting, recreating the removed target's series and holding
/// `/readyz` at 503 for a target no reload would ever clear; and a target re-added under
/// the same name (its URL changed) would get the old task's outcome. A task stops at its
/// next await, so this takes no longer than one poll of each.
async fn stop_pushers(
    hub: &Hub,
    stopped: Vec<(String, watch::Sender<bool>, JoinHandle<()>)>,
    configured: &[&str],
) {
    let mut names = Vec::new();
    for (name, stop, task) in stopped {
        let _ = stop.send(true);
        task.abort();
        // A cancelled task's JoinError is expected; a panicked one was already reported.
        let _ = task.await;
        names.push(name);
    }
    for name in &names {
        // Its stats reader was aborted with the push task, before it could forget itself;
        // a restarted task's reader reads the gateway again.
        hub.forget_gateway(name);
        if configured.contains(&name.as_str()) {
            // Restarted (its URL or settings changed): what the old task saw is not the new
            // one's; a rejection of the old URL must not hold `/readyz` at 503 while the
            // new URL fails for another reason.
            hub.set_push_rejected(name, None);
            hub.telemetry.clear_auth_rejected(name);
        } else {
            hub.telemetry.forget_target(name);
        }
    }
    hub.retain_push_targets(configured);
}

async fn supervise(
    hub: Arc<Hub>,
    endpoints: Arc<Merged<EndpointSpec>>,
    targets: Arc<Merged<Target>>,
    mut settings: Settings,
    mut _tokens: Tokens,
    mut reload: mpsc::Receiver<Reload>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut scrape_client = scrape::client(
        scrape::connect_timeout(settings.scrape.timeout),
        &settings.tls.scrape.subscribe(),
    );
    let mut push_client = push::client(settings.push.timeout, &settings.tls.push.subscribe());
    let mut endpoints_rx = endpoints.subscribe();
    let mut targets_rx = targets.subscribe();
    let mut scrapers: BTreeMap<String, (EndpointSpec, watch::Sender<bool>, JoinHandle<()>)> =
        BTreeMap::new();
    let mut pushers: BTreeMap<String, (Target, watch::Sender<bool>, JoinHandle<()>)> =
        BTreeMap::new();
    let mut watches = start_watches(&settings, &scrape_client, &endpoints, &targets);
    let mut restart_scrapers = false;
    let mut restart_pushers = false;
    loop {
        let specs = endpoints_rx.borrow_and_update().clone();
        hub.set_endpoints(&specs);
        // Stop tasks whose endpoint is gone or changed (or all, on a settings change).
        let by_id: std::collections::HashMap<&str, &EndpointSpec> =
            specs.iter().map(|s| (s.id.as_str(), s)).collect();
        scrapers.retain(|id, (spec, stop, _)| {
            let keep = !restart_scrapers && by_id.get(id.as_str()).is_some_and(|s| *s == spec);
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
                    settings.scrape_token.for_pool(&spec.pool),
                    stop_rx,
                ));
                scrapers.insert(spec.id.clone(), (spec.clone(), stop, task));
            }
        }
        // Same for push targets: a new gateway pod gets the current snapshot at once.
        let current = targets_rx.borrow_and_update().clone();
        let (kept, stopped): (BTreeMap<_, _>, BTreeMap<_, _>) = std::mem::take(&mut pushers)
            .into_iter()
            .partition(|(name, (target, _, _))| {
                !restart_pushers && current.iter().any(|t| &t.name == name && t == target)
            });
        pushers = kept;
        let names: Vec<&str> = current.iter().map(|t| t.name.as_str()).collect();
        stop_pushers(
            &hub,
            stopped
                .into_iter()
                .map(|(name, (_, stop, task))| (name, stop, task))
                .collect(),
            &names,
        )
        .await;
        for t in current.iter() {
            if !pushers.contains_key(&t.name) {
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
                pushers.insert(t.name.clone(), (t.clone(), stop, task));
            }
        }
        restart_scrapers = false;
        restart_pushers = false;
        tokio::select! {
            r = endpoints_rx.changed() => if r.is_err() { break },
            r = targets_rx.changed() => if r.is_err() { break },
            msg = reload.recv() => match msg {
                Some(Reload { config, tokens, kube, tls }) => {
                    // Clients (and their TLS sources) are replaced when their section changes;
                    // tasks of unchanged sections keep running with the sources they hold,
                    // which keep watching the same files.
                    // A token from an env var can change under the same settings.
                    let scrape_token_changed = config.scrape.token() != settings.scrape.token()
                        || config.scrape.pool_tokens != settings.scrape.pool_tokens
                        || tokens.scrape_tokens().values() != settings.scrape_token.values();
                    restart_scrapers = config.scrape != settings.scrape || scrape_token_changed;
                    restart_pushers = config.push != settings.push
                        || *tokens.push.subscribe().borrow() != *settings.token.borrow();
                    // A TLS source is replaced only when its files are: Kubernetes watch
                    // tasks keep the scrape client they started with, and its source goes
                    // on following rotations of the same files.
                    if config.scrape.tls != settings.scrape.tls {
                        settings.tls.scrape = tls.scrape;
                    }
                    if config.push.tls != settings.push.tls {
                        settings.tls.push = tls.push;
                    }
                    if restart_scrapers {
                        scrape_client = scrape::client(
                            scrape::connect_timeout(config.scrape.timeout),
                            &settings.tls.scrape.subscribe(),
                        );
                    }
                    if restart_pushers {
                        push_client =
                            push::client(config.push.timeout, &settings.tls.push.subscribe());
                    }
                    // InferencePool watches read pods' `/v1/models` with the scrape token: a
                    // new token source restarts them too.
                    let restart_watches = config.kubernetes != settings.kubernetes
                        || (scrape_token_changed && settings.kube.is_some());
                    // Running tasks hold receivers of the old sources; they are restarted
                    // with the new ones.
                    if restart_pushers {
                        _tokens.push = tokens.push;
                        settings.token = _tokens.push.subscribe();
                    }
                    if restart_scrapers {
                        warn_no_scrape_token(&config.scrape, &tokens.scrape, &tokens.pools);
                        _tokens.scrape = tokens.scrape;
                        _tokens.pools = tokens.pools;
                        settings.scrape_token = _tokens.scrape_tokens();
                    }
                    settings.token_source = config.push.token_source().into();
                    settings.scrape = config.scrape;
                    settings.push = config.push;
                    if restart_watches {
                        stop_all(&mut watches);
                        endpoints.clear_prefix(kubernetes::SLOT_PREFIX);
                        targets.clear_prefix(gateways::SLOT_PREFIX);
                        settings.kubernetes = config.kubernetes;
                        settings.kube = kube;
                        watches = start_watches(&settings, &scrape_client, &endpoints, &targets);
                    }
                    tracing::info!(restart_scrapers, restart_pushers, restart_watches, "config reloaded");
                }
                None => break,
            },
            _ = shutdown.changed() => break,
        }
    }
    stop_all(&mut watches);
    for (_, (_, stop, task)) in scrapers {
        let _ = stop.send(true);
        task.abort();
    }
    for (_, (_, stop, task)) in pushers {
        let _ = stop.send(true);
        task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A target restarted under the same name (its URL changed) starts clean: the old
    /// URL's token rejection no longer holds `/readyz` at 503, and its gauge reads 0.
    #[tokio::test]
    async fn a_restarted_target_drops_the_old_urls_rejection() {
        let hub = Hub::new(Duration::from_secs(1), Duration::ZERO, Duration::ZERO);
        hub.publish();
        hub.retain_push_targets(&["gw"]);
        hub.set_push_rejected("gw", Some("HTTP 401 from the old URL".into()));
        let label = crate::telemetry::TargetLabel {
            target: "gw".into(),
        };
        hub.telemetry
            .push_auth_rejected
            .get_or_create(&label)
            .set(1);
        assert!(!hub.ready());
        let (stop, _rx) = watch::channel(false);
        let task = tokio::spawn(async {});
        stop_pushers(&hub, vec![("gw".into(), stop, task)], &["gw"]).await;
        assert_eq!(hub.not_ready_reason(), None);
        assert!(hub
            .telemetry
            .encode()
            .contains("kvroute_cp_push_auth_rejected{target=\"gw\"} 0"));
    }

    /// A push in flight when a reload removes its target: the ingest answers 401 only
    /// after the removal. Before, the task was only told to stop (a flag it reads between
    /// pushes, not during one), so the late 401 marked the removed target rejected
    /// (`/readyz` 503 for good: no reload clears a target that is not configured) and
    /// recreated its metric series after `forget_target`.
    #[tokio::test]
    async fn a_removed_targets_late_401_leaves_no_trace() {
        let ingest = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = ingest.local_addr().unwrap().port();
        let (got_post, mut post_seen) = mpsc::channel::<()>(1);
        tokio::spawn(async move {
            let (mut conn, _) = ingest.accept().await.unwrap();
            let mut buf = vec![0u8; 64 * 1024];
            let _ = conn.read(&mut buf).await.unwrap();
            let _ = got_post.send(()).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            let _ = conn
                .write_all(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n")
                .await;
            // Hold the connection so the client reads the answer, not a reset.
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        let config = Config::from_yaml(&format!(
            "targets:\n  - name: gone\n    url: http://127.0.0.1:{port}/kvroute/v1/snapshot\n\
             push:\n  timeout_ms: 5000\n"
        ))
        .unwrap();
        let hub = Hub::new(Duration::from_secs(1), Duration::ZERO, Duration::ZERO);
        hub.publish();
        hub.retain_push_targets(&["gone"]);
        let tls = TlsSource::start("push.tls", &config.push.tls, Default::default()).unwrap();
        let (_token_tx, token) = watch::channel(None);
        let (stop, stop_rx) = watch::channel(false);
        let task = tokio::spawn(push::run_target(
            hub.clone(),
            push::client(config.push.timeout, &tls.subscribe()),
            config.targets[0].clone(),
            config.push.clone(),
            token,
            "environment variable `KVROUTE_INGEST_TOKEN`".into(),
            stop_rx,
        ));
        // The POST is in flight; the reload removes the target.
        tokio::time::timeout(Duration::from_secs(5), post_seen.recv())
            .await
            .unwrap();
        stop_pushers(&hub, vec![("gone".into(), stop, task)], &[]).await;
        // Past the 401.
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(hub.not_ready_reason(), None);
        assert!(hub.ready());
        let metrics = hub.telemetry.encode();
        assert!(!metrics.contains("target=\"gone\""), "{metrics}");
    }
}
