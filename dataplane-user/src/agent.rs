//! The node agent's life cycle: check the host, read the config, attach the
//! kernel programs, re-adopt the pods a previous agent enrolled, serve the
//! control socket until SIGINT/SIGTERM, then keep or remove kernel state as
//! `--on-exit` says.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    signal::unix::{SignalKind, signal},
    sync::watch,
};
use tracing::{info, warn};

use crate::{
    cli::RunArgs,
    config::{ConfigError, LocalConfig},
    control,
    engine::MeshContext,
    enroll::{EngineSettings, EnrollError, Enrollments, PodSpec, StateFile},
    identity::{Ca, CertStore},
    logging::Chain,
    preflight::{self, PreflightError, PreflightInput},
    redirect::{ExitMode, PinLayout, RedirectError, Redirector, RedirectorOptions},
    state::WorkloadIndex,
    tls::{self, ClientConfigCache},
};

/// How long GOAWAY frames get to leave before connections are closed.
const GOAWAY_GRACE: Duration = Duration::from_millis(100);

/// Pooled HBONE connections unused this long are closed.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How often enrolled pods' network namespaces are checked for removal.
const REAP_INTERVAL: Duration = Duration::from_secs(2);

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
    /// Installing signal handlers failed.
    #[error("cannot install signal handlers")]
    Signal(#[source] std::io::Error),
}

/// Runs the agent until SIGINT or SIGTERM.
pub async fn run(args: RunArgs) -> Result<(), AgentError> {
    // Installed first: a SIGTERM that arrives while programs are being
    // attached must still lead to an orderly shutdown, not the default kill.
    let mut sigterm = signal(SignalKind::terminate()).map_err(AgentError::Signal)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(AgentError::Signal)?;
    let config = match &args.config {
        Some(path) => LocalConfig::from_file(path)?,
        None => LocalConfig::embedded()?,
    };
    info!(origin = %config.origin, workloads = config.workloads.len(), "configuration loaded");

    let cgroup = preflight::check(&PreflightInput {
        bpffs: &args.state.bpffs,
        cgroup: args.cgroup.as_deref(),
    })?;
    let MeshParts {
        mesh,
        shutdown_tx,
        rotation,
    } = mesh_context(&args, &config)?;
    let pins = PinLayout::new(&args.state.bpffs, &args.state.instance);
    let mut options = RedirectorOptions::new(cgroup, pins.clone());
    options.config.proxy_mark = args.proxy_mark;
    options.fail_open = args.fail_open;
    options.probe_sources = args.probe_sources.clone();
    let redirector = Arc::new(Mutex::new(Redirector::attach(&options)?));

    let instance_dir = args.state.state_dir.join(&args.state.instance);
    let mut enrollments = Enrollments::new(
        Arc::clone(&redirector),
        pins,
        EngineSettings {
            proxy_mark: args.proxy_mark,
            mesh,
        },
        StateFile::in_dir(&instance_dir),
    );
    let adopted = enrollments.readopt()?;
    if adopted > 0 {
        info!(
            pods = adopted,
            "re-adopted pods enrolled before the restart"
        );
    }
    enroll_standalone(&mut enrollments, &config, args.node.as_deref());
    let enrollments = Arc::new(Mutex::new(enrollments));

    let socket = control::socket_path(&args.state.state_dir, &args.state.instance);
    let listener = control::bind(&socket).map_err(|source| AgentError::Control {
        path: socket.clone(),
        source,
    })?;
    let control_task = tokio::spawn(control::serve(listener, Arc::clone(&enrollments)));
    let reaper_task = tokio::spawn(reap_vanished(Arc::clone(&enrollments)));

    info!(instance = %args.state.instance, control = %socket.display(), on_exit = ?args.on_exit, fail_open = args.fail_open, "agent ready");
    tokio::select! {
        _ = sigterm.recv() => info!("SIGTERM received, stopping"),
        _ = sigint.recv() => info!("SIGINT received, stopping"),
    }
    // HBONE servers send GOAWAY; give the frames a moment to leave.
    let _ = shutdown_tx.send(true);
    tokio::time::sleep(GOAWAY_GRACE).await;
    rotation.abort();
    control_task.abort();
    reaper_task.abort();
    // Wait for them to go: they hold references to the pods and the
    // redirector, which the shutdown below must own.
    let _ = control_task.await;
    let _ = reaper_task.await;
    let _ = std::fs::remove_file(&socket);
    shutdown(enrollments, redirector, args.on_exit)?;
    info!("agent stopped");
    Ok(())
}

/// Enrolls the config's workloads that name a network namespace
/// (standalone mode, no CNI). A pod that cannot be enrolled is logged and
/// skipped so one bad entry does not take the node's other pods down.
fn enroll_standalone(enrollments: &mut Enrollments, config: &LocalConfig, node: Option<&str>) {
    for workload in &config.workloads {
        let Some(netns) = &workload.netns else {
            continue;
        };
        if node.is_some_and(|node| node != workload.node) {
            continue;
        }
        let spec = PodSpec {
            uid: workload.uid.clone(),
            name: workload.name.clone(),
            namespace: workload.namespace.clone(),
            service_account: workload.service_account.clone(),
            trust_domain: workload.trust_domain.clone(),
            netns: netns.clone(),
            ips: workload.workload_ips.clone(),
            node_addr: None,
            exclusions: Default::default(),
        };
        if let Err(err) = enrollments.add(spec) {
            warn!(uid = %workload.uid, error = %Chain(&err), "cannot enroll a configured workload");
        }
    }
}

/// What [`mesh_context`] sets up.
struct MeshParts {
    mesh: Arc<MeshContext>,
    /// Send `true` to make HBONE servers drain.
    shutdown_tx: watch::Sender<bool>,
    /// The certificate rotation task.
    rotation: tokio::task::JoinHandle<()>,
}

/// The CA, certificate store (with its rotation task), workload index and
/// drain signal every pod's engine shares.
fn mesh_context(args: &RunArgs, config: &LocalConfig) -> Result<MeshParts, AgentError> {
    tls::install_provider();
    let ca = match (&args.ca_cert, &args.ca_key) {
        (Some(cert), Some(key)) => Ca::from_files(cert, key)?,
        _ => {
            let dir = args
                .ca_dir
                .clone()
                .unwrap_or_else(|| args.state.state_dir.join("ca"));
            Ca::load_or_generate(&dir)?
        }
    };
    let roots = Arc::new(ca.root_cert_store()?);
    let certs = Arc::new(CertStore::new(
        Arc::new(ca),
        tls::provider(),
        args.cert_lifetime,
    ));
    let rotation = Arc::clone(&certs).spawn_rotation();
    let workloads = WorkloadIndex::from_config(config)?;
    let (shutdown_tx, shutdown) = watch::channel(false);
    let mesh = Arc::new(MeshContext {
        workloads: std::sync::RwLock::new(Arc::new(workloads)),
        client_configs: ClientConfigCache::new(Arc::clone(&certs), Arc::clone(&roots), 1024),
        certs,
        roots,
        trust_domain: args.trust_domain.clone(),
        shutdown,
        pool_idle_timeout: POOL_IDLE_TIMEOUT,
        // Authorization policies arrive with the live-configuration work;
        // until then every client of the trust domain is allowed.
        authorize: Arc::new(|_, _| true),
    });
    Ok(MeshParts {
        mesh,
        shutdown_tx,
        rotation,
    })
}

async fn reap_vanished(enrollments: Arc<Mutex<Enrollments>>) {
    let mut ticker = tokio::time::interval(REAP_INTERVAL);
    loop {
        ticker.tick().await;
        let mut guard = match enrollments.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        guard.reap_vanished();
    }
}

/// Stops serving, then keeps or removes kernel state.
fn shutdown(
    enrollments: Arc<Mutex<Enrollments>>,
    redirector: Arc<Mutex<Redirector>>,
    mode: ExitMode,
) -> Result<(), AgentError> {
    {
        let mut guard = match enrollments.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        guard.stop_serving();
        if mode == ExitMode::Detach {
            guard.clear_state()?;
        }
    }
    drop(enrollments);
    if mode == ExitMode::Keep {
        // Pods stay enrolled but nobody serves them: the fail-open or
        // fail-closed setting now decides their traffic.
        let mut guard = match redirector.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        };
        guard.set_engine_ready(false)?;
    }
    let redirector = match Arc::try_unwrap(redirector) {
        Ok(mutex) => match mutex.into_inner() {
            Ok(r) => r,
            Err(poisoned) => poisoned.into_inner(),
        },
        Err(_) => {
            warn!("kernel state still in use at shutdown; leaving it pinned");
            return Ok(());
        }
    };
    redirector.shutdown(mode)?;
    Ok(())
}
