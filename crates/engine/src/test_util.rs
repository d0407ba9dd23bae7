//! Test fixtures (feature `test-util`; other crates enable it from their
//! dev-dependencies, so the agent never compiles it): a pod's
//! [`PodContext`] built without enrollment and without kernel programs.
//!
//! The pod lives in a network namespace the fixture creates (`ip netns
//! add`, deleted on drop) with only its loopback up, so every address is a
//! loopback one and nothing leaves the namespace. Its certificates come
//! from the shared test CA ([`dataplane_identity::test_util::TestCa`]);
//! its mesh state from a local configuration (the YAML of
//! `--config`). Original destinations come from the product's netfilter
//! source ([`crate::proxy::orig_dst::OrigDst::Netfilter`], the iptables
//! capture of the benchmarks' baseline): [`TestPod::redirect`] adds the
//! `REDIRECT` rule the capture would, so the listeners run as they do in a
//! pod, on real sockets.
//!
//! It needs root (`ip netns`, `iptables`), as the integration tests do.
//! Set-up failures panic (a fixture that cannot be built is a broken test).

use std::{
    io,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use dataplane_common::{HBONE_PORT, INBOUND_PLAINTEXT_PORT, OUTBOUND_PORT};
use dataplane_identity::test_util::TestCa;
use tokio::sync::watch;

use crate::{
    config::LocalConfig,
    hbone::HbonePool,
    identity::Identity,
    mesh::MeshContext,
    proxy::{
        PodContext, PodEngine, PodIdentity, PodListeners, PodNetns, PodTlsDialer,
        handshakes::{HandshakeLimits, PendingHandshakes},
        outbound::OutboundTrafficPolicy,
        pod_netns,
    },
    state::MeshState,
    telemetry::{Metrics, Peer},
    tls::ClientConfigCache,
    workers::Workers,
};

/// The mark of the test pod's engine sockets, which its `REDIRECT` rules
/// leave alone (the agent's default `--proxy-mark`).
pub const TEST_MARK: u32 = 0x539;

/// A network namespace of one test, named `dpt-unit-<pid>-<n>`; deleted when
/// dropped (with every socket left in it). The name follows the integration
/// tests' `dpt-<tag>-<pid>-<n>`, so their sweep (`tests/src/stale.rs`)
/// removes one a killed test process left behind.
#[derive(Debug)]
pub struct TestNetns {
    name: String,
    netns: PodNetns,
}

impl TestNetns {
    /// Creates the namespace and brings its loopback up.
    ///
    /// # Panics
    ///
    /// When `ip` cannot create or set it up (the tests need root).
    pub fn create() -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "dpt-unit-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        run("ip", &["netns", "add", &name]).expect("ip netns add");
        // Dropped (and the namespace deleted) if what follows fails.
        let path = PathBuf::from("/run/netns").join(&name);
        let netns = PodNetns::open(&path).expect("open the test namespace");
        let made = Self { name, netns };
        made.exec(&["ip", "link", "set", "lo", "up"])
            .expect("bring the test namespace's loopback up");
        made
    }

    /// The namespace as a pod's.
    pub fn netns(&self) -> &PodNetns {
        &self.netns
    }

    /// Its path (`/run/netns/NAME`).
    pub fn path(&self) -> &Path {
        self.netns.path()
    }

    /// Runs a command inside the namespace (`ip netns exec`).
    pub fn exec(&self, command: &[&str]) -> io::Result<()> {
        let mut args = vec!["netns", "exec", self.name.as_str()];
        args.extend_from_slice(command);
        run("ip", &args)
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = run("ip", &["netns", "del", &self.name]);
    }
}

/// Runs `program` with `args`; an error when it fails to start or exits
/// non-zero (with what it printed on stderr).
fn run(program: &str, args: &[&str]) -> io::Result<()> {
    let out = Command::new(program).args(args).output()?;
    if out.status.success() {
        return Ok(());
    }
    Err(io::Error::other(format!(
        "{program} {}: {}: {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}

/// The mesh-wide context of a test agent: `config` (a local
/// configuration's YAML) as its state, `ca`'s certificates, the agent's
/// defaults otherwise, no control plane (enrolled pods are served whether
/// or not the state lists them), no fast path, no DNS resolver.
///
/// # Panics
///
/// When `config` does not parse.
pub fn mesh_context(ca: &TestCa, config: &str) -> (Arc<MeshContext>, watch::Sender<bool>) {
    dataplane_identity::crypto::install_provider();
    let config = LocalConfig::parse(config, "test").expect("the test mesh configuration");
    let state = MeshState::from_config(&config).expect("the test mesh state");
    let (shutdown_tx, shutdown) = watch::channel(false);
    let metrics = Arc::new(Metrics::new());
    let limits = HandshakeLimits {
        node: 1024,
        per_pod: 256,
        per_source: 256,
        timeout: Duration::from_secs(10),
    };
    let mesh = Arc::new(MeshContext {
        state: std::sync::RwLock::new(Arc::new(state)),
        dead: Default::default(),
        live: Default::default(),
        config_error: Default::default(),
        client_configs: ClientConfigCache::new(Arc::clone(&ca.store), Arc::clone(&ca.roots), 64),
        certs: Arc::clone(&ca.store),
        roots: Arc::clone(&ca.roots),
        trust_domain: dataplane_identity::test_util::TRUST_DOMAIN.to_owned(),
        shutdown,
        drain_timeout: Duration::from_secs(5),
        pool_idle_timeout: Duration::from_secs(60),
        pool_spread: Default::default(),
        h2: Default::default(),
        early_data: false,
        outbound_traffic_policy: OutboundTrafficPolicy::AllowAny,
        handshakes: Arc::new(PendingHandshakes::new(limits, Arc::clone(&metrics))),
        hbone_idle_timeout: Duration::from_secs(60),
        localhost_app_tunnel: true,
        require_known_workloads: false,
        network: Arc::from(""),
        keepalive: None,
        metrics,
        fast_path: Default::default(),
        resolver: Default::default(),
    });
    (mesh, shutdown_tx)
}

/// Who the test pod is and what mesh it is in; [`TestPodBuilder::build`]
/// makes it.
#[derive(Debug)]
pub struct TestPodBuilder {
    namespace: String,
    account: String,
    ips: Vec<IpAddr>,
    config: String,
}

impl TestPodBuilder {
    /// The pod's SPIFFE identity: `namespace` and service `account`
    /// (default `test`/`test`).
    pub fn identity(mut self, namespace: &str, account: &str) -> Self {
        namespace.clone_into(&mut self.namespace);
        account.clone_into(&mut self.account);
        self
    }

    /// The pod's IPs (default `127.0.0.2`): loopback addresses of its
    /// namespace.
    pub fn ips(mut self, ips: &[IpAddr]) -> Self {
        self.ips = ips.to_vec();
        self
    }

    /// The mesh state, as a local configuration's YAML (default empty).
    pub fn config(mut self, yaml: &str) -> Self {
        yaml.clone_into(&mut self.config);
        self
    }

    /// A namespace, a CA, the mesh context and the pod's context, as
    /// enrollment builds them (`dataplane-user`'s `enroll::builtin`), with
    /// no original-source connections and [`TEST_MARK`] as its mark.
    ///
    /// # Panics
    ///
    /// When any part cannot be set up.
    pub fn build(self) -> TestPod {
        let netns = TestNetns::create();
        let ca = TestCa::new();
        let (mesh, shutdown) = mesh_context(&ca, &self.config);
        let spiffe = TestCa::identity(&self.namespace, &self.account);
        let server_tls = ca.server_config(&spiffe);
        let cookie = netns.netns().cookie().expect("the test namespace's cookie");
        let pool = HbonePool::with_settings(
            PodTlsDialer {
                netns: netns.netns().clone(),
                mark: TEST_MARK,
                mesh: Arc::clone(&mesh),
            },
            mesh.pool_idle_timeout,
            mesh.pool_spread,
            mesh.h2,
        );
        let name = format!("{}-pod", self.account);
        let ctx = Arc::new(PodContext {
            identity: PodIdentity {
                uid: format!("{}/{name}", self.namespace),
                name: name.clone(),
                namespace: self.namespace.clone(),
            },
            peer: Arc::new(Peer {
                workload: Some(name.into()),
                namespace: Some(self.namespace.into()),
                principal: Some(spiffe.as_uri().into()),
                ..Default::default()
            }),
            spiffe,
            ips: self.ips,
            fast_path: None,
            netns: netns.netns().clone(),
            netns_cookie: cookie,
            mark: TEST_MARK,
            original_source: None,
            mesh,
            pool,
            server_tls,
            baggage: Default::default(),
            stopping: watch::Sender::new(false),
        });
        TestPod {
            ctx,
            ca,
            shutdown,
            netns,
        }
    }
}

/// A pod's context without enrollment, in a namespace of its own. Drop
/// its engine before it (the namespace goes with it).
#[derive(Debug)]
pub struct TestPod {
    /// The pod's context, as its listeners take it.
    pub ctx: Arc<PodContext>,
    /// The CA its certificates (and its peers') come from.
    pub ca: TestCa,
    /// The agent's drain signal (`true`: drain).
    pub shutdown: watch::Sender<bool>,
    /// Its namespace.
    pub netns: TestNetns,
}

impl TestPod {
    /// A builder with the defaults: identity `test`/`test`, IP
    /// `127.0.0.2`, an empty mesh.
    pub fn builder() -> TestPodBuilder {
        TestPodBuilder {
            namespace: "test".to_owned(),
            account: "test".to_owned(),
            ips: vec![IpAddr::from([127, 0, 0, 2])],
            config: String::new(),
        }
    }

    /// The pod's in-pod listeners (`127.0.0.1:15001`, `0.0.0.0:15006`,
    /// `0.0.0.0:15008`, IPv4 only), serving on the current runtime with
    /// original destinations from netfilter.
    ///
    /// # Panics
    ///
    /// When the listeners cannot be made or started; outside a Tokio
    /// runtime.
    pub fn start(&self) -> PodEngine {
        let listeners = PodListeners::create(self.netns.netns(), false).expect("the listeners");
        let placement = Workers::shared(tokio::runtime::Handle::current()).place();
        PodEngine::start(Arc::clone(&self.ctx), listeners, None, placement)
            .expect("start the engine")
    }

    /// Sends the pod's TCP connections to `dst` (but not its engine's) to
    /// the listener on `to_port` of the pod ([`OUTBOUND_PORT`] or
    /// [`INBOUND_PLAINTEXT_PORT`]), as an iptables capture does.
    ///
    /// # Panics
    ///
    /// When iptables refuses the rule.
    pub fn redirect(&self, dst: SocketAddr, to_port: u16) {
        assert!(
            matches!(to_port, OUTBOUND_PORT | INBOUND_PLAINTEXT_PORT),
            "only the capture listeners take redirected connections"
        );
        let (ip, port, to) = (
            dst.ip().to_string(),
            dst.port().to_string(),
            to_port.to_string(),
        );
        let mark = format!("{TEST_MARK:#x}");
        self.netns
            .exec(&[
                "iptables",
                "-w",
                "-t",
                "nat",
                "-A",
                "OUTPUT",
                "-p",
                "tcp",
                "-d",
                &ip,
                "--dport",
                &port,
                "-m",
                "mark",
                "!",
                "--mark",
                &mark,
                "-j",
                "REDIRECT",
                "--to-ports",
                &to,
            ])
            .expect("add the REDIRECT rule");
    }

    /// A listening socket inside the pod (an app, or a peer on another
    /// loopback address).
    ///
    /// # Panics
    ///
    /// When the address is taken.
    pub fn listen(&self, addr: SocketAddr) -> tokio::net::TcpListener {
        let listener = self
            .netns
            .netns()
            .listen(addr, false)
            .expect("listen in the pod");
        tokio::net::TcpListener::from_std(listener).expect("a Tokio listener")
    }

    /// Connects from inside the pod, unmarked (as an app does: captured).
    pub async fn connect(&self, dst: SocketAddr) -> io::Result<tokio::net::TcpStream> {
        let socket = self.netns.netns().connector(dst, 0, None)?;
        pod_netns::connect(socket, dst).await
    }

    /// The pod's HBONE address on `ip`.
    pub fn hbone_addr(ip: IpAddr) -> SocketAddr {
        SocketAddr::new(ip, HBONE_PORT)
    }

    /// `spiffe://cluster.local/ns/{namespace}/sa/{account}`.
    pub fn identity(namespace: &str, account: &str) -> Identity {
        TestCa::identity(namespace, account)
    }
}
