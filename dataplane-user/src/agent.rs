//! The node agent's life cycle: check the host, read the config, attach the
//! kernel programs, re-adopt the pods a previous agent enrolled, serve the
//! control socket until SIGINT/SIGTERM, then keep or remove kernel state as
//! `--on-exit` says. With `--takeover` it takes a running agent's pods and
//! listening sockets over instead; an agent whose pods were taken over
//! drains and leaves everything to its successor ([`crate::handover`]).

use std::{
    future::Future,
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::{
    net::TcpListener,
    signal::unix::{SignalKind, signal},
    sync::{Notify, watch},
    task::JoinHandle,
};
use tracing::{info, warn};

pub mod config;

use crate::{
    admin,
    agent::config::{AfterHandover, AgentConfig, CaConfig, Capture, CertsConfig, EngineConfig},
    config::{ConfigError, LocalConfig},
    control,
    enroll::{
        EngineSettings, EnrollError, Enroller, Enrollments, ExternalEngine, Standalone, StateFile,
        ZtunnelEvents,
    },
    handover,
    identity::{Ca, CertDir, CertSource, CertStore, IstioCa, TrustBundle},
    inspect::{AgentView, Endpoints, KernelPrograms},
    mesh::MeshContext,
    preflight::{self, PreflightError, PreflightInput},
    proxy::handshakes::{HandshakeLimits, PendingHandshakes},
    readiness::{Readiness, Step},
    redirect::{PinLayout, RedirectError, Redirector, RedirectorOptions},
    reload,
    sources::{self, ConfigSources},
    state::MeshState,
    telemetry::{self, Metrics, StateCollector},
    tls::{self, ClientConfigCache},
    workers::{Threading, Workers},
    xds::{XdsClient, XdsMetrics},
};

/// How long GOAWAY frames get to leave before connections are closed.
const GOAWAY_GRACE: Duration = Duration::from_millis(100);

/// How often the drain checks whether connections are still open.
const DRAIN_POLL: Duration = Duration::from_millis(50);

/// Pooled HBONE connections unused this long are closed.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Why the agent stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The host lacks something the agent needs.
    #[error(transparent)]
    Preflight(#[from] PreflightError),
    /// The configuration is unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Loading, attaching or pinning kernel programs failed.
    #[error(transparent)]
    Redirect(#[from] RedirectError),
    /// Re-adopting enrolled pods failed.
    #[error(transparent)]
    Enroll(#[from] EnrollError),
    /// The connection worker threads could not start.
    #[error(transparent)]
    Workers(#[from] crate::workers::WorkersError),
    /// The DNS settings are unusable.
    #[error(transparent)]
    Dns(#[from] crate::dns::DnsError),
    /// The control socket could not be bound.
    #[error("cannot bind the control socket {path}")]
    Control {
        /// The socket path.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The workload state is unusable.
    #[error(transparent)]
    State(#[from] crate::state::StateError),
    /// The CA or certificates could not be set up.
    #[error(transparent)]
    Ca(#[from] crate::identity::CaError),
    /// Another agent of this instance is running.
    #[error(transparent)]
    Instance(#[from] crate::instance::InstanceError),
    /// Taking over from the running agent failed.
    #[error(transparent)]
    Handover(#[from] crate::handover::HandoverError),
    /// Installing signal handlers failed.
    #[error("cannot install signal handlers")]
    Signal(#[source] std::io::Error),
    /// The Kubernetes client for --kube could not be set up.
    #[error(transparent)]
    Kube(#[from] crate::kube::KubeError),
    /// istiod's root certificate file is unusable.
    #[error(transparent)]
    IstiodRoots(#[from] config::RootsError),
    /// `--original-source on` cannot work on this host.
    #[error(transparent)]
    OriginalSource(#[from] config::OriginalSourceError),
    /// The certificate source's roots cannot form a trust bundle.
    #[error("cannot trust the roots of {source_name}: {source}")]
    TrustBundle {
        /// The certificate source.
        source_name: String,
        /// Why.
        #[source]
        source: crate::identity::TrustBundleError,
    },
    /// The mounted certificate directory has no usable root bundle.
    #[error(transparent)]
    CertDir(#[from] crate::identity::CertDirError),
    /// `--cert-source istio` in a configuration without istiod (one not
    /// built by `RunArgs::into_config`).
    #[error("--cert-source istio needs --istiod-address")]
    NoIstiod,
}

/// Runs the agent until SIGINT, SIGTERM or the admin `/quitquitquit`,
/// then drains.
pub async fn run(args: AgentConfig) -> Result<(), AgentError> {
    info!(config = %serde_json::to_string(&args).unwrap_or_default(), "agent configuration");
    let args = Arc::new(args);
    let started = Instant::now();
    // First: a container runtime starts us with 1,024 descriptors whatever
    // the hard limit, and every connection costs descriptors.
    let nofile = crate::nofile::raise_to_hard();
    // Installed first: a SIGTERM that arrives while programs are being
    // attached must still lead to an orderly shutdown, not the default kill.
    let mut sigterm = signal(SignalKind::terminate()).map_err(AgentError::Signal)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(AgentError::Signal)?;
    let readiness = Arc::new(Readiness::default());
    let readiness_task = {
        let readiness = Arc::clone(&readiness);
        start_endpoint(
            "readiness",
            "GET /healthz/ready",
            args.endpoints.readiness,
            args.takeover,
            |l| crate::readiness::serve(l, readiness),
        )
        .await
    };
    let xds_config = args.xds_config()?;
    if xds_config.is_none() {
        readiness.done(Step::Xds);
    }
    let config = match &args.workloads_file {
        Some(path) => LocalConfig::from_file(path)?,
        None => LocalConfig::embedded()?,
    };
    info!(origin = %config.origin, workloads = config.workloads.len(), "configuration loaded");
    let config = Arc::new(config);
    readiness.done(Step::Config);

    let cgroup = preflight::check(&PreflightInput {
        bpffs: &args.state.bpffs,
        cgroup: args.redirect.cgroup.as_deref(),
    })?;
    // Before any state is touched (CA, kernel programs, pods, the control
    // socket): a second agent of this instance must change nothing, unless
    // it takes over (then it receives the lock and the pods' sockets).
    let (instance_lock, mut incoming) = handover::acquire(
        args.state.state_dir.clone(),
        args.state.instance.clone(),
        args.takeover,
    )
    .await?;
    let MeshParts {
        mesh,
        shutdown_tx,
        rotation,
    } = mesh_context(&args, &config, nofile)?;
    let metrics_task = {
        let metrics = Arc::clone(&mesh.metrics);
        start_endpoint(
            "metrics",
            "GET /metrics",
            args.endpoints.metrics,
            args.takeover,
            |l| telemetry::serve(l, metrics),
        )
        .await
    };
    let pins = PinLayout::new(&args.state.bpffs, &args.state.instance);
    let mut options = RedirectorOptions::new(cgroup, pins.clone());
    options.config.proxy_mark = args.redirect.proxy_mark;
    options.config.transparent_mark = args.original_source.kernel_mark();
    options.fail_open = args.redirect.fail_open;
    options.probe_sources = args.redirect.probe_sources.clone();
    options.node_netns = args.redirect.node_netns.clone();
    // Under iptables capture (the benchmarks' baseline) no kernel program
    // is loaded: rules someone else installed steer traffic to the same
    // listeners.
    let redirector = match args.capture {
        Capture::Ebpf => Some(Redirector::attach(&options)?),
        Capture::Iptables => {
            info!("iptables capture: no kernel program loaded or attached");
            None
        }
    };
    if redirector.is_some() && matches!(args.engine, EngineConfig::Builtin) {
        start_fast_path(&pins, args.redirect.fast_path, &mesh);
    }
    let kernel = redirector.as_ref().map(|r| {
        let (programs, cgroup) = r.attached();
        KernelPrograms {
            programs,
            cgroup: cgroup.to_path_buf(),
        }
    });
    let original_source = args.original_source.decide(match &redirector {
        Some(r) if r.original_source_supported() => Ok(()),
        Some(_) => Err("no transparent mark is configured"),
        None => Err("iptables capture (our sk_lookup is not loaded)"),
    })?;
    readiness.done(Step::Programs);

    // DNS is captured by the kernel programs only.
    let dns = match redirector {
        Some(_) => Some(Arc::new(crate::dns::DnsSettings::new(
            &args.dns,
            Arc::clone(&mesh),
            args.redirect.proxy_mark,
        )?)),
        None => None,
    };
    // `--engine ztunnel`: the ZDS server starts once the pods enrolled
    // before are re-adopted, so ztunnel's first snapshot has them all.
    let ztunnel_events = Arc::new(ZtunnelEvents::default());
    let external = match &args.engine {
        EngineConfig::Builtin => None,
        EngineConfig::Ztunnel { zds } => Some(ExternalEngine::new(
            zds.clone(),
            Arc::clone(&ztunnel_events),
        )),
    };
    // From here on the enrollment actor owns the pods and the kernel
    // programs; everything else sends it commands.
    let instance_dir = args.state.state_dir.join(&args.state.instance);
    let workers = Arc::new(match args.workers.threading {
        Threading::Pinned => Workers::pinned(args.workers.threads.map_or_else(
            || std::thread::available_parallelism().map_or(1, usize::from),
            usize::from,
        ))?,
        Threading::Shared => Workers::shared(tokio::runtime::Handle::current()),
    });
    let enroller = Enroller::start(
        Enrollments::new(
            redirector,
            pins.clone(),
            EngineSettings {
                proxy_mark: args.redirect.proxy_mark,
                original_source,
                mesh: Arc::clone(&mesh),
                dns,
                external,
                workers,
            },
            StateFile::in_dir(&instance_dir),
        ),
        Standalone::new(args.node.clone()),
    )?;
    let adopted = match incoming.as_mut() {
        Some(handed) => handover::readopt(handed, &enroller).await?,
        None => enroller.readopt().await?,
    };
    if adopted > 0 {
        info!(
            pods = adopted,
            "re-adopted pods enrolled before the restart"
        );
    }
    enroller.apply_config(Arc::clone(&config)).await?;
    ztunnel_events.connect(enroller.clone());
    enroller.start_ztunnel().await?;
    // Enrollment asks for each pod's certificate; readiness holds back
    // while one is missing (the CA down, the files not mounted yet).
    {
        let certs = Arc::clone(&mesh.certs);
        readiness.add_check("certificates", Box::new(move || certs.missing()));
    }
    readiness.done(Step::Certificates);
    mesh.metrics.register_collector(Box::new(StateCollector {
        pins: kernel.as_ref().map(|_| pins.clone()),
        enrolled_pods: {
            let view = enroller.view();
            Box::new(move || view.snapshot().pods.len())
        },
        certs: Arc::clone(&mesh.certs),
    }));
    // With --kube, this node's pods that opted in are enrolled (and those
    // gone unenrolled) from the Kubernetes API; configured workloads stay.
    let kube_task = if let Some(kube) = &args.kube {
        Some(
            crate::kube::start_for_agent(
                crate::kube::AgentReconcilerOptions {
                    node: Some(kube.node.clone()),
                    kubeconfig: kube.kubeconfig.clone(),
                    trust_domain: args.mesh.trust_domain.clone(),
                    keep: config.workloads.iter().map(|w| w.uid.clone()).collect(),
                    rule: kube.rule.clone(),
                },
                enroller.clone(),
                &mesh.metrics,
            )
            .await?,
        )
    } else {
        None
    };

    let sources = Arc::new(ConfigSources::new(
        Arc::clone(&mesh),
        enroller.clone(),
        Arc::clone(&config),
    ));
    let (xds, xds_status) = match xds_config {
        Some(xds_config) => {
            let origin = format!("xds://{}", xds_config.istiod.address);
            let metrics = XdsMetrics::registered(&mut mesh.metrics.registry());
            let (client, snapshots, status) = XdsClient::new(xds_config);
            let (client, applied) = client.with_metrics(metrics).ack_when_applied();
            (Some((client, snapshots, origin, applied)), Some(status))
        }
        None => (None, None),
    };

    let socket = control::socket_path(&args.state.state_dir, &args.state.instance);
    let control_err = |source| AgentError::Control {
        path: socket.clone(),
        source,
    };
    let staged = control::bind(&socket).map_err(control_err)?;
    // Every pod is served: the running agent may stop accepting.
    if let Some(handed) = incoming.take()
        && let Err(err) = handed.confirm()
    {
        // It is gone: its sockets and lock are this agent's alone now.
        warn!(error = %crate::logging::Chain(&err), "the agent taken over from did not hear the confirmation");
    }
    let listener = staged.publish().map_err(control_err)?;
    let socket_identity = file_identity(&socket);
    let admin_listener = bind_endpoint(
        "admin",
        "/config_dump, /logging, /quitquitquit",
        args.endpoints.admin,
        args.takeover,
    )
    .await;
    let endpoints = Endpoints {
        readiness: readiness_task.as_ref().map(|(_, addr)| *addr),
        metrics: metrics_task.as_ref().map(|(_, addr)| *addr),
        admin: admin_listener.as_ref().map(|(_, addr)| *addr),
    };
    let view = Arc::new(AgentView {
        instance: args.state.instance.clone(),
        capture: args.capture.name(),
        fail_open: args.redirect.fail_open,
        config: Arc::clone(&args),
        endpoints,
        readiness: Arc::clone(&readiness),
        mesh: Arc::clone(&mesh),
        enroller: enroller.clone(),
        kernel,
        pins: PinLayout::new(&args.state.bpffs, &args.state.instance),
        started,
        xds: xds_status,
        annotations: kube_task.as_ref().map(|t| Arc::clone(&t.annotations)),
    });
    let giver = handover::Giver::new(instance_lock, enroller.clone());
    let control_task = tokio::spawn(control::serve(
        listener,
        Arc::clone(&view),
        Arc::clone(&giver),
    ));
    let quit = Arc::new(Notify::new());
    let admin_task = admin_listener.map(|(listener, _)| {
        let (view, quit) = (Arc::clone(&view), Arc::clone(&quit));
        tokio::spawn(async move {
            if let Some(listener) = listener.await {
                admin::serve(listener, view, quit).await;
            }
        })
    });
    drop(view);
    // Only a config file can change; the embedded default cannot.
    let reload_task = args
        .workloads_file
        .clone()
        .map(|path| tokio::spawn(reload::watch(path, Arc::clone(&mesh), Arc::clone(&sources))));
    let xds_tasks = xds.map(|(client, snapshots, origin, applied)| {
        let follow = sources::follow_xds(
            snapshots,
            Arc::clone(&sources),
            origin,
            Arc::clone(&readiness),
            applied,
        );
        [tokio::spawn(client.run()), tokio::spawn(follow)]
    });

    release_startup_memory();
    info!(instance = %args.state.instance, control = %socket.display(), on_exit = ?args.redirect.on_exit, fail_open = args.redirect.fail_open, "agent ready");
    // Whether the stop came from a hand-over rather than a signal or
    // /quitquitquit: only then may the process have to outlive its drain.
    let stopped_by_handover = tokio::select! {
        _ = sigterm.recv() => { info!("SIGTERM received, draining"); false }
        _ = sigint.recv() => { info!("SIGINT received, draining"); false }
        () = quit.notified() => { info!("/quitquitquit received, draining"); false }
        pid = giver.handed_over() => {
            info!(new_pid = pid, "pods handed over to a new agent, draining");
            true
        }
    };
    // A signal during a hand-over waits for its outcome: once handed over,
    // kernel state is the new agent's, whatever --on-exit says.
    let handed_over = giver.settle().await.is_some();
    readiness.start_draining();
    drain(&mesh, &shutdown_tx, args.mesh.drain_timeout).await;
    rotation.abort();
    let endpoint_tasks = [readiness_task, metrics_task]
        .into_iter()
        .flatten()
        .map(|(task, _)| task);
    for task in endpoint_tasks.chain(admin_task) {
        task.abort();
        let _ = task.await;
    }
    control_task.abort();
    if let Some(tasks) = kube_task {
        for task in [tasks.reconcile, tasks.annotate] {
            task.abort();
            let _ = task.await;
        }
    }
    for task in reload_task
        .into_iter()
        .chain(xds_tasks.into_iter().flatten())
    {
        task.abort();
        let _ = task.await;
    }
    let _ = control_task.await;
    // Only the socket this agent created: a path replaced since belongs to
    // someone else.
    if socket_identity.is_some() && file_identity(&socket) == socket_identity {
        let _ = std::fs::remove_file(&socket);
    }
    if handed_over {
        // Kernel state, the state file and the lock are the new agent's.
        enroller.release().await?;
    } else {
        enroller.shutdown(args.redirect.on_exit).await?;
    }
    if stopped_by_handover && args.after_handover == AfterHandover::Wait {
        // A pod's container that exits is restarted by the kubelet, and
        // the restarted agent (run with --takeover) would take the pods
        // back from the new pod's. Holding nothing now, wait for the pod's
        // deletion (SIGTERM); a signal that came during the drain is
        // still pending and ends this at once.
        info!(
            "handed over and drained; idle until SIGTERM (--after-handover wait), holding no lock, socket, port or kernel state"
        );
        tokio::select! {
            _ = sigterm.recv() => info!("SIGTERM received"),
            _ = sigint.recv() => info!("SIGINT received"),
        }
    }
    info!("agent stopped");
    Ok(())
}

/// `(device, inode)` of the file at `path`, if there is one.
fn file_identity(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt as _;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// Gives back to the kernel the heap that loading the kernel object (ELF,
/// BTF, relocations) and reading the configuration used and freed: glibc
/// keeps freed memory in its arenas otherwise, about 2.5 MiB of resident
/// memory for the agent's whole life.
fn release_startup_memory() {
    // SAFETY: malloc_trim only returns free heap pages to the kernel; it
    // takes no pointers and is safe to call at any time.
    #[cfg(target_env = "gnu")]
    unsafe {
        libc::malloc_trim(0);
    }
}

/// An endpoint's listener, now or once its port is free.
type ListenerSoon = std::pin::Pin<Box<dyn Future<Output = Option<TcpListener>> + Send>>;

/// Binds an HTTP endpoint. A port already in use (another agent on the
/// same host) is logged loudly and start-up goes on: probes and scrapes
/// then fail, which is visible, instead of the node losing its data plane.
/// With `--takeover` the port in use is the agent's being taken over from:
/// it is bound as soon as that agent exits (see [`handover`]).
async fn bind_endpoint(
    name: &'static str,
    paths: &'static str,
    addr: SocketAddr,
    takeover: bool,
) -> Option<(ListenerSoon, SocketAddr)> {
    match crate::httpd::bind(addr).await {
        Ok(listener) => {
            // Port 0 asks the kernel for one: report the one it chose.
            let bound = listener.local_addr().unwrap_or(addr);
            info!(addr = %bound, "{name} endpoint listening ({paths})");
            Some((Box::pin(std::future::ready(Some(listener))), bound))
        }
        Err(err) if takeover && err.kind() == std::io::ErrorKind::AddrInUse => {
            info!(%addr, "{name} endpoint: the port is the running agent's; bound once it exits");
            Some((Box::pin(handover::bind_when_free(name, addr)), addr))
        }
        Err(err) => {
            warn!(%addr, error = %err, "cannot serve the {name} endpoint; set --{name}-addr");
            None
        }
    }
}

/// Binds an HTTP endpoint (see [`bind_endpoint`]) and serves it.
async fn start_endpoint<F, Fut>(
    name: &'static str,
    paths: &'static str,
    addr: SocketAddr,
    takeover: bool,
    serve: F,
) -> Option<(JoinHandle<()>, SocketAddr)>
where
    F: FnOnce(TcpListener) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (listener, bound) = bind_endpoint(name, paths, addr, takeover).await?;
    let serve = async move {
        if let Some(listener) = listener.await {
            serve(listener).await;
        }
    };
    Some((tokio::spawn(serve), bound))
}

/// Stops accepting (in-pod listeners close, HBONE servers send GOAWAY),
/// then waits until every open connection has finished or `deadline` has
/// passed; the caller then closes what is left.
async fn drain(mesh: &MeshContext, shutdown_tx: &watch::Sender<bool>, deadline: Duration) {
    let _ = shutdown_tx.send(true);
    let until = Instant::now() + deadline;
    info!(
        open_connections = mesh.metrics.open_connections(),
        deadline_ms = deadline.as_millis() as u64,
        "draining: listeners closed, HBONE peers told GOAWAY"
    );
    loop {
        let open = mesh.metrics.open_connections();
        if open <= 0 {
            info!("drained: every connection finished");
            break;
        }
        if Instant::now() >= until {
            warn!(
                open_connections = open,
                "drain deadline passed; closing the connections still open"
            );
            break;
        }
        tokio::time::sleep(DRAIN_POLL).await;
    }
    // GOAWAY frames need a moment to leave even when nothing was open.
    tokio::time::sleep(GOAWAY_GRACE).await;
}

/// What [`mesh_context`] sets up.
struct MeshParts {
    mesh: Arc<MeshContext>,
    /// Send `true` to make HBONE servers drain.
    shutdown_tx: watch::Sender<bool>,
    /// The certificate rotation task.
    rotation: tokio::task::JoinHandle<()>,
}

/// Opens the same-node fast path and starts its telemetry. Without it
/// (maps missing, kernel refusing) every connection takes the proxy:
/// slower, never wrong, so the agent goes on.
fn start_fast_path(pins: &PinLayout, default_on: bool, mesh: &Arc<MeshContext>) {
    let fast = match crate::fast_path::FastPath::open(pins, default_on) {
        Ok(fast) => Arc::new(fast),
        Err(err) => {
            return warn!(error = %crate::logging::Chain(&err), "same-node fast path unavailable; every connection goes through the proxy");
        }
    };
    if let Err(err) = fast.report_closed(pins, Arc::downgrade(mesh)) {
        return warn!(error = %crate::logging::Chain(&err), "same-node fast path unavailable (its close records cannot be read); every connection goes through the proxy");
    }
    info!(
        default = if default_on { "on" } else { "off" },
        "same-node fast path ready"
    );
    let _ = mesh.fast_path.set(fast);
}

/// The CA, certificate store (with its rotation task), workload index and
/// drain signal every pod's engine shares.
fn mesh_context(
    args: &AgentConfig,
    config: &LocalConfig,
    nofile: crate::nofile::NofileLimit,
) -> Result<MeshParts, AgentError> {
    tls::install_provider();
    let (source, roots) = cert_source(args)?;
    let roots =
        Arc::new(
            TrustBundle::new(roots).map_err(|source_err| AgentError::TrustBundle {
                source_name: source.describe(),
                source: source_err,
            })?,
        );
    info!(source = source.kind(), from = %source.describe(), roots = roots.roots().len(), "workload certificate source");
    let certs = Arc::new(CertStore::new(
        source,
        Arc::clone(&roots),
        tls::provider(),
        args.mesh.cert_lifetime,
    ));
    let rotation = Arc::clone(&certs).spawn_rotation();
    let state = MeshState::from_config(config)?;
    let (shutdown_tx, shutdown) = watch::channel(false);
    let metrics = Arc::new(Metrics::new());
    let handshakes = handshake_limits(args, nofile);
    let mesh = Arc::new(MeshContext {
        state: std::sync::RwLock::new(Arc::new(state)),
        dead: Default::default(),
        live: Default::default(),
        config_error: Default::default(),
        client_configs: ClientConfigCache::new(Arc::clone(&certs), Arc::clone(&roots), 1024),
        certs,
        roots,
        trust_domain: args.mesh.trust_domain.clone(),
        shutdown,
        drain_timeout: args.mesh.drain_timeout,
        pool_idle_timeout: POOL_IDLE_TIMEOUT,
        pool_spread: args.mesh.pool_spread,
        early_data: args.mesh.hbone_early_data,
        handshakes: Arc::new(PendingHandshakes::new(handshakes, Arc::clone(&metrics))),
        hbone_idle_timeout: args.mesh.hbone_idle_timeout,
        require_known_workloads: args.xds.is_some(),
        keepalive: args.mesh.keepalive,
        metrics,
        fast_path: Default::default(),
    });
    Ok(MeshParts {
        mesh,
        shutdown_tx,
        rotation,
    })
}

/// The certificate source `--cert-source` names, and the roots the trust
/// bundle starts with (the CA's, istiod's root file, or the mounted
/// `root-cert.pem`).
fn cert_source(
    args: &AgentConfig,
) -> Result<(CertSource, Vec<rustls::pki_types::CertificateDer<'static>>), AgentError> {
    match (&args.certs, &args.istiod) {
        (CertsConfig::Builtin { ca }, _) => {
            let ca = match ca {
                CaConfig::Files { cert, key } => Ca::from_files(cert, key)?,
                CaConfig::Dir(dir) => Ca::load_or_generate(dir)?,
            };
            let root = ca.root_der().clone();
            Ok((CertSource::Builtin(Arc::new(ca)), vec![root]))
        }
        (CertsConfig::Istio, Some(istiod)) => {
            let roots = config::read_root_certs(&istiod.root_cert)?;
            let ca = IstioCa {
                istiod: istiod.endpoint()?,
                impersonate: true,
            };
            Ok((CertSource::Istio(ca), roots))
        }
        (CertsConfig::Istio, None) => Err(AgentError::NoIstiod),
        (CertsConfig::Files { dir }, _) => {
            let dir = CertDir::new(dir.clone());
            let roots = dir.read_roots()?;
            Ok((CertSource::Files(dir), roots))
        }
    }
}

/// The bounds on inbound HBONE handshakes: the flags, the node-wide one
/// derived from the descriptor limit unless set.
fn handshake_limits(args: &AgentConfig, nofile: crate::nofile::NofileLimit) -> HandshakeLimits {
    let as_usize = |n: u32| usize::try_from(n).unwrap_or(usize::MAX);
    let limits = HandshakeLimits {
        node: args
            .mesh
            .max_pending_handshakes
            .map_or_else(|| nofile.default_handshake_budget(), as_usize),
        per_pod: as_usize(args.mesh.max_pending_handshakes_per_pod),
        per_source: as_usize(args.mesh.max_pending_handshakes_per_source),
        timeout: args.mesh.hbone_handshake_timeout,
    };
    info!(
        node = limits.node,
        per_pod = limits.per_pod,
        per_source = limits.per_source,
        timeout_ms = limits.timeout.as_millis() as u64,
        idle_timeout_ms = args.mesh.hbone_idle_timeout.as_millis() as u64,
        fd_limit = nofile.soft,
        "inbound HBONE handshake bounds"
    );
    if limits.node as u64 > nofile.soft / 2 {
        warn!(
            node = limits.node,
            fd_limit = nofile.soft,
            "--max-pending-handshakes is over half the file descriptor limit: a flood of handshakes can take the descriptors the node's pods need"
        );
    }
    limits
}
