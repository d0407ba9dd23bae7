//! Start-up: everything from the configuration to an agent that serves
//! its pods and its endpoints, returned as the [`Bound`] running parts.

use std::{path::PathBuf, sync::Arc, time::Instant};

use tokio::{
    sync::{Notify, watch},
    task::JoinHandle,
};
use tracing::{info, warn};

use super::{
    AgentError,
    config::{AgentConfig, Capture, EngineConfig},
    endpoints::{bind_endpoint, start_endpoint},
    mesh::{MeshParts, mesh_context},
};
use crate::{
    admin,
    config::LocalConfig,
    control,
    enroll::{
        EngineSettings, Enroller, Enrollments, ExternalEngine, NodeCollector, Standalone,
        StateFile, ZtunnelEvents,
    },
    handover,
    inspect::{AgentView, Endpoints, KernelPrograms},
    kube::KubeTasks,
    mesh::MeshContext,
    preflight::{self, PreflightInput},
    readiness::{Readiness, Step},
    redirect::{PinLayout, Redirector, RedirectorOptions},
    reload,
    sources::{self, ConfigSources},
    telemetry::{self, StateCollector},
    workers::{Threading, Workers},
    xds::{XdsClient, XdsMetrics},
};

/// A started agent's running parts (as ztunnel's `Bound`): its tasks,
/// endpoints and enrollments, until [`Bound::shut_down`].
pub struct Bound {
    /// The configuration it runs with.
    pub(super) config: Arc<AgentConfig>,
    /// Start-up progress and drain state.
    pub(super) readiness: Arc<Readiness>,
    /// Workloads, certificates, connections.
    pub(super) mesh: Arc<MeshContext>,
    /// Send `true` to make HBONE servers drain.
    pub(super) shutdown_tx: watch::Sender<bool>,
    /// The certificate rotation task.
    pub(super) rotation: JoinHandle<()>,
    /// The readiness and metrics endpoints' tasks.
    pub(super) endpoint_tasks: Vec<JoinHandle<()>>,
    /// The admin endpoint's task.
    pub(super) admin_task: Option<JoinHandle<()>>,
    /// The control socket's server.
    pub(super) control_task: JoinHandle<()>,
    /// The Kubernetes reconciler and annotator, with `--kube`.
    pub(super) kube_task: Option<KubeTasks>,
    /// The config file watch, and the xDS client and follower.
    pub(super) source_tasks: Vec<JoinHandle<()>>,
    /// The control socket's path.
    pub(super) socket: PathBuf,
    /// `(device, inode)` of the control socket this agent created.
    pub(super) socket_identity: Option<(u64, u64)>,
    /// Enrolled pods, and enrollment commands.
    pub(super) enroller: Enroller,
    /// Hands the pods over to a new agent.
    pub(super) giver: Arc<handover::Giver>,
    /// Notified by `/quitquitquit` and [`Bound::stop`].
    pub(super) quit: Arc<Notify>,
    /// Where the HTTP endpoints listen.
    pub(super) endpoints: Endpoints,
}

impl std::fmt::Debug for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bound")
            .field("instance", &self.config.state.instance)
            .field("control", &self.socket)
            .field("endpoints", &self.endpoints)
            .finish_non_exhaustive()
    }
}

impl Bound {
    /// Where the HTTP endpoints listen (the ports chosen for port 0).
    pub fn endpoints(&self) -> Endpoints {
        self.endpoints
    }

    /// The control socket's path.
    pub fn control_socket(&self) -> &std::path::Path {
        &self.socket
    }

    /// Asks the agent to stop, as `/quitquitquit` does: [`Bound::wait`]
    /// returns.
    pub fn stop(&self) {
        self.quit.notify_one();
    }
}

/// Starts the agent: host checks, configuration, kernel programs, the pods
/// enrolled before, the control socket and the HTTP endpoints. Signals are
/// the caller's ([`super::Signals`]); an in-process agent (a test) stops
/// with [`Bound::stop`].
pub async fn start(config: AgentConfig) -> Result<Bound, AgentError> {
    info!(config = %serde_json::to_string(&config).unwrap_or_default(), "agent configuration");
    let args = Arc::new(config);
    let started = Instant::now();
    // Before any TLS configuration (istiod, HBONE) is built: the policy is
    // process-wide, as ztunnel's.
    crate::tls::set_policy(args.mesh.tls)?;
    if args.mesh.tls != crate::tls::TlsPolicy::default() {
        info!(policy = ?args.mesh.tls, "TLS policy");
    }
    // First: a container runtime starts us with 1,024 descriptors whatever
    // the hard limit, and every connection costs descriptors.
    let nofile = crate::nofile::raise_to_hard();
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
        args.ipv6_enabled,
    )
    .await?;
    let MeshParts {
        mesh,
        shutdown_tx,
        rotation,
    } = mesh_context(&args, &config, nofile).await?;
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
    options.ipv6_listeners = args.ipv6_enabled;
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
        Some(_) => Some(Arc::new(crate::dns::DnsSettings {
            ipv6: args.ipv6_enabled,
            ..crate::dns::DnsSettings::new(&args.dns, Arc::clone(&mesh), args.redirect.proxy_mark)?
        })),
        None => None,
    };
    if let Some(dns) = &dns {
        // Endpoints known by DNS name are resolved through the same
        // upstream servers and cache as the pods' forwarded queries.
        let _ = mesh.resolver.set(Arc::clone(&dns.forwarder));
    }
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
                ipv6: args.ipv6_enabled,
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
    mesh.metrics.register_collector(Box::new(NodeCollector {
        pods: enroller.view(),
        zds: matches!(args.engine, EngineConfig::Ztunnel { .. })
            .then(|| Arc::clone(&ztunnel_events)),
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
                    keep: config.workloads.iter().map(|w| w.uid.to_string()).collect(),
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
    let socket_identity = super::file_identity(&socket);
    let admin_listener = bind_endpoint(
        "admin",
        "/config_dump, /logging, /quitquitquit, /debug/pprof",
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

    super::release_startup_memory();
    info!(instance = %args.state.instance, control = %socket.display(), on_exit = ?args.redirect.on_exit, fail_open = args.redirect.fail_open, "agent ready");
    let endpoint_tasks = [readiness_task, metrics_task]
        .into_iter()
        .flatten()
        .map(|(task, _)| task)
        .collect();
    Ok(Bound {
        config: args,
        readiness,
        mesh,
        shutdown_tx,
        rotation,
        endpoint_tasks,
        admin_task,
        control_task,
        kube_task,
        source_tasks: reload_task
            .into_iter()
            .chain(xds_tasks.into_iter().flatten())
            .collect(),
        socket,
        socket_identity,
        enroller,
        giver,
        quit,
        endpoints,
    })
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
