//! The settings and handles every pod's engine shares ([`MeshContext`]):
//! the certificate source and store, the workload index, the handshake
//! bounds and the drain signal.

use std::sync::Arc;

use tokio::sync::watch;
use tracing::{info, warn};

use super::{
    AgentError,
    config::{self, AgentConfig, CaConfig, CertsConfig},
};
use crate::{
    config::LocalConfig,
    identity::{
        Ca, CertDir, CertSource, CertStore, IstioCa, RevocationList, TrustBundle, WorkloadApi,
    },
    mesh::MeshContext,
    proxy::handshakes::{HandshakeLimits, PendingHandshakes},
    state::MeshState,
    telemetry::Metrics,
    tls::{self, ClientConfigCache},
};

/// What [`mesh_context`] sets up.
pub(super) struct MeshParts {
    pub(super) mesh: Arc<MeshContext>,
    /// Send `true` to make HBONE servers drain.
    pub(super) shutdown_tx: watch::Sender<bool>,
    /// The certificate rotation task.
    pub(super) rotation: tokio::task::JoinHandle<()>,
}

/// The CA, certificate store (with its rotation task), workload index and
/// drain signal every pod's engine shares.
pub(super) async fn mesh_context(
    args: &AgentConfig,
    config: &LocalConfig,
    nofile: crate::nofile::NofileLimit,
) -> Result<MeshParts, AgentError> {
    tls::install_provider();
    let (source, roots) = cert_source(args).await?;
    let roots =
        Arc::new(
            TrustBundle::new(roots).map_err(|source_err| AgentError::TrustBundle {
                source_name: source.describe(),
                source: source_err,
            })?,
        );
    info!(source = source.kind(), from = %source.describe(), roots = roots.roots().len(), "workload certificate source");
    if let Some(path) = &args.mesh.crl_path {
        let list = Arc::new(RevocationList::load(path.clone())?);
        info!(path = %path.display(), crls = list.len(), "HBONE peers are checked against revocation lists");
        // The watch ends when the bundle, the list's only other holder,
        // is dropped with the mesh.
        drop(RevocationList::watch(&list));
        roots.set_revocations(Some(list));
    }
    let certs = Arc::new(CertStore::new(
        source,
        Arc::clone(&roots),
        tls::provider(),
        args.mesh.cert_lifetime,
    ));
    let rotation = Arc::clone(&certs).spawn_rotation();
    // Captured traffic is looked up on this node's network (ztunnel
    // `NETWORK`; `WorkloadIndex::by_ip`).
    let state = MeshState::from_config(config)?.on_network(&args.network);
    let (shutdown_tx, shutdown) = watch::channel(false);
    let metrics = Arc::new(Metrics::new());
    metrics.set_access_log_sample(args.access_log_sample);
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
        pool_idle_timeout: args.mesh.pool_idle_timeout,
        pool_spread: args.mesh.pool_spread,
        h2: args.mesh.h2,
        early_data: args.mesh.hbone_early_data,
        outbound_traffic_policy: args.mesh.outbound_traffic_policy,
        handshakes: Arc::new(PendingHandshakes::new(handshakes, Arc::clone(&metrics))),
        hbone_idle_timeout: args.mesh.hbone_idle_timeout,
        localhost_app_tunnel: args.mesh.localhost_app_tunnel,
        require_known_workloads: args.xds.is_some(),
        network: Arc::from(args.network.as_str()),
        keepalive: args.mesh.keepalive,
        metrics,
        fast_path: Default::default(),
        resolver: Default::default(),
    });
    Ok(MeshParts {
        mesh,
        shutdown_tx,
        rotation,
    })
}

/// How long the agent waits at start for the SPIFFE Workload API's first
/// answer (SPIRE attests the caller first), before it gives up with the
/// last attempt's error.
const SPIFFE_FIRST_ANSWER: std::time::Duration = std::time::Duration::from_secs(30);

/// The certificate source `--cert-source` names, and the roots the trust
/// bundle starts with (the CA's, istiod's root file, the mounted
/// `root-cert.pem`, or the Workload API's bundle of the mesh's trust
/// domain).
async fn cert_source(
    args: &AgentConfig,
) -> Result<(CertSource, Vec<rustls::pki_types::CertificateDer<'static>>), AgentError> {
    match &args.certs {
        CertsConfig::Builtin { ca } => {
            let ca = match ca {
                CaConfig::Files { cert, key } => Ca::from_files(cert, key)?,
                CaConfig::Dir(dir) => Ca::load_or_generate(dir)?,
            };
            let root = ca.root_der().clone();
            Ok((CertSource::Builtin(Arc::new(ca)), vec![root]))
        }
        CertsConfig::Istio { ca, mesh_roots } => {
            let roots = config::read_root_certs(mesh_roots)?;
            let ca = IstioCa {
                istiod: ca.endpoint()?,
                impersonate: true,
            };
            Ok((CertSource::Istio(ca), roots))
        }
        CertsConfig::Files { dir } => {
            let dir = CertDir::new(dir.clone());
            let roots = dir.read_roots()?;
            Ok((CertSource::Files(dir), roots))
        }
        CertsConfig::Spiffe { endpoint } => {
            let api = WorkloadApi::new(endpoint)?;
            let roots = api
                .first_roots(&args.mesh.trust_domain, SPIFFE_FIRST_ANSWER)
                .await?;
            Ok((CertSource::Spiffe(api), roots))
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
