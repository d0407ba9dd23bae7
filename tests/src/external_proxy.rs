//! One simulated node whose pods are served by an external in-pod proxy
//! (`dp-inpod-proxy`, a stand-in for Istio's ztunnel: its own process, in
//! the node's namespace and a cgroup of its own under the node's, with its
//! listeners inside the pods' namespaces) and an in-process [`Redirector`]
//! aimed at that proxy's sockets: the kernel side of the external-engine
//! mode without an agent process or ZDS.
//!
//! Pods: `app` and `app2` (served by the proxy once a test enrolls them;
//! their app answers `app peer=<client address>` on 8080) and `peer` (plain;
//! answers `peer` on 8080). Guards detach the redirector, kill the proxy and
//! remove namespaces, cgroups and pins even when a test fails.

use std::{
    fs::File,
    net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener},
    os::fd::AsFd,
    process::Command,
};

use dataplane_common::DEFAULT_TRANSPARENT_MARK;
use dataplane_user::{
    PodNetns, SourceRouting,
    redirect::{
        Exclusions, ExitMode, ExternalListeners, ExternalPodCapture, HarvestError, PinLayout,
        Redirector, RedirectorOptions,
    },
};

use crate::{
    BpffsDir, Cgroup, ChildGuard, Responder,
    process::target_binary,
    redirector_node::LIMIT,
    spawn_in,
    topology::{Node, Pod},
};

/// Port every app listens on.
pub const APP_PORT: u16 = 8080;

/// The source Istio gives kubelet's probes (SNAT of node-local
/// connections to pod IPs); the agent's default probe source.
pub const ISTIO_PROBE_SOURCE: std::net::Ipv4Addr = std::net::Ipv4Addr::new(169, 254, 7, 127);

/// The in-pod routing the agent installs for original source (the
/// defaults of `--original-source-table` and the rule priority).
pub const ROUTING: SourceRouting = SourceRouting {
    mark: DEFAULT_TRANSPARENT_MARK,
    table: DEFAULT_TRANSPARENT_MARK,
    priority: 32764,
};

/// The stand-in proxy process.
#[derive(Debug)]
pub struct InpodProxy {
    child: ChildGuard,
    pid: u32,
    // After the child: the cgroup can only go once the process is gone.
    _cgroup: Cgroup,
}

impl InpodProxy {
    /// Starts the proxy in `node`'s namespace, serving `pods` (name, pod),
    /// and waits until every listener is bound.
    pub fn start(node: &Node, pods: &[(&str, &Pod)]) -> anyhow::Result<Self> {
        let cgroup = Cgroup::child(node.cgroup(), "ztunnel")?;
        let mut cmd = Command::new(target_binary(
            "dp-inpod-proxy",
            "build it with `cargo build -p dataplane-tests --bins`",
        )?);
        for (name, pod) in pods {
            cmd.arg(format!("{name}={}", pod.netns.path().display()));
        }
        let mut child = spawn_in(cmd, Some(node.netns().path()), Some(cgroup.path()))?;
        let pid = child
            .id()
            .ok_or_else(|| anyhow::anyhow!("the proxy has no pid"))?;
        let line = child.first_line(LIMIT)?;
        anyhow::ensure!(line == "ready", "dp-inpod-proxy said {line:?}");
        Ok(Self {
            child,
            pid,
            _cgroup: cgroup,
        })
    }

    /// The proxy's pid (what the agent reads from the ZDS connection's
    /// `SO_PEERCRED`).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Kills the proxy and waits until it is gone (its sockets closed).
    pub fn kill(self) -> anyhow::Result<()> {
        self.child.signal(nix::sys::signal::Signal::SIGKILL)?;
        self.child.wait(LIMIT)?;
        Ok(())
    }
}

/// The node, its pods, the proxy and the redirector. Field order is drop
/// order: the redirector detaches first, the proxy dies before the pods.
pub struct ExternalProxyNode {
    /// The in-process redirector.
    pub redirector: Option<Redirector>,
    /// The stand-in proxy (`None` while a test has it stopped).
    pub proxy: Option<InpodProxy>,
    _apps: Vec<Responder>,
    /// A pod served by the proxy.
    pub app: Pod,
    /// A second pod served by the same proxy.
    pub app2: Pod,
    /// A plain pod: the clients, and a server answering `peer`.
    pub peer: Pod,
    /// The node.
    pub node: Node,
    /// Where the redirector's maps and links are pinned.
    pub pins: PinLayout,
    _bpffs: BpffsDir,
}

impl ExternalProxyNode {
    /// Builds the world and starts the proxy for `app` and `app2`;
    /// `configure` adjusts the redirector options. Nothing is enrolled.
    pub fn new(tag: &str, configure: impl FnOnce(&mut RedirectorOptions)) -> anyhow::Result<Self> {
        let bpffs = BpffsDir::new(tag)?;
        let mut node = Node::new(tag, 1)?;
        let app = node.add_pod(tag)?;
        let app2 = node.add_pod(tag)?;
        let peer = node.add_pod(tag)?;
        let apps = vec![
            peer_aware_server(&app)?,
            peer_aware_server(&app2)?,
            fixed_server(&peer, "peer")?,
        ];
        let pins = PinLayout::new(bpffs.path(), "xp");
        let mut options = RedirectorOptions::new(node.cgroup().path().to_path_buf(), pins.clone());
        // The agent's default (`--probe-source`): Istio's kubelet probe SNAT.
        options.probe_sources = vec![IpAddr::V4(ISTIO_PROBE_SOURCE)];
        configure(&mut options);
        let redirector = Redirector::attach(&options)?;
        let proxy = InpodProxy::start(&node, &[("app", &app), ("app2", &app2)])?;
        Ok(Self {
            redirector: Some(redirector),
            proxy: Some(proxy),
            _apps: apps,
            app,
            app2,
            peer,
            node,
            pins,
            _bpffs: bpffs,
        })
    }

    /// The attached redirector.
    pub fn redirector(&mut self) -> anyhow::Result<&mut Redirector> {
        self.redirector
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("redirector gone"))
    }

    /// The running proxy's pid.
    pub fn proxy_pid(&self) -> anyhow::Result<u32> {
        Ok(self
            .proxy
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("the proxy is stopped"))?
            .pid())
    }

    /// Enrolls `pod` for the external proxy (capture, `lo` program) and
    /// installs its original-source routing, as the agent does before it
    /// hands the namespace to the proxy.
    pub fn enroll(&mut self, pod: WhichPod) -> anyhow::Result<()> {
        let (netns_path, cookie, ips, node_addr) = {
            let p = self.pod(pod);
            (
                p.netns.path().to_path_buf(),
                p.netns.cookie()?,
                [IpAddr::V4(p.ip4), IpAddr::V6(p.ip6)],
                p.node_side,
            )
        };
        let netns = File::open(&netns_path)?;
        let exclusions = Exclusions::default();
        self.redirector()?
            .enroll_external_pod(&ExternalPodCapture {
                netns_cookie: cookie,
                netns: netns.as_fd(),
                ips: &ips,
                node_addr: Some(node_addr),
                exclusions: &exclusions,
                dns_capture: false,
            })?;
        ROUTING.install(&PodNetns::open(&netns_path)?)?;
        Ok(())
    }

    /// Copies the proxy's listeners in `pod` (the listener harvest).
    pub fn harvest(&self, pod: WhichPod) -> Result<ExternalListeners, HarvestError> {
        let pid = self.proxy.as_ref().map_or(0, InpodProxy::pid);
        let netns = File::open(self.pod(pod).netns.path()).map_err(|source| HarvestError::Os {
            action: "open the pod's namespace file".into(),
            pid,
            source,
        })?;
        ExternalListeners::harvest(pid, netns.as_fd(), 15006, 15008)
    }

    /// Harvests the proxy's listeners in `pod` and registers them.
    pub fn harvest_and_register(&mut self, pod: WhichPod) -> anyhow::Result<()> {
        let listeners = self.harvest(pod)?;
        let cookie = self.pod(pod).netns.cookie()?;
        self.redirector()?.set_pod_listeners(cookie, listeners)?;
        Ok(())
    }

    /// Restarts the proxy (a new process with new sockets).
    pub fn restart_proxy(&mut self) -> anyhow::Result<()> {
        if let Some(proxy) = self.proxy.take() {
            proxy.kill()?;
        }
        self.proxy = Some(InpodProxy::start(
            &self.node,
            &[("app", &self.app), ("app2", &self.app2)],
        )?);
        Ok(())
    }

    /// One of the pods.
    pub fn pod(&self, which: WhichPod) -> &Pod {
        match which {
            WhichPod::App => &self.app,
            WhichPod::App2 => &self.app2,
            WhichPod::Peer => &self.peer,
        }
    }

    /// One kernel counter.
    pub fn counter(&self, name: &str) -> anyhow::Result<u64> {
        crate::counters::one(&self.pins, name)
    }
}

impl Drop for ExternalProxyNode {
    fn drop(&mut self) {
        if let Some(r) = self.redirector.take()
            && let Err(e) = r.shutdown(ExitMode::Detach)
        {
            eprintln!("cleanup: {e}");
        }
    }
}

/// The pods of [`ExternalProxyNode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhichPod {
    /// `app`.
    App,
    /// `app2`.
    App2,
    /// `peer`.
    Peer,
}

/// A server on `[::]:8080` in `pod` answering `app peer=<client address>`.
fn peer_aware_server(pod: &Pod) -> anyhow::Result<Responder> {
    let listener = listen_any(pod)?;
    Responder::start(listener, |req| {
        format!("app peer={}", req.peer.ip().to_canonical()).into_bytes()
    })
}

/// A server on `[::]:8080` in `pod` answering `answer`.
fn fixed_server(pod: &Pod, answer: &'static str) -> anyhow::Result<Responder> {
    let listener = listen_any(pod)?;
    Responder::start(listener, move |_| answer.as_bytes().to_vec())
}

fn listen_any(pod: &Pod) -> anyhow::Result<TcpListener> {
    let any = SocketAddr::new(Ipv6Addr::UNSPECIFIED.into(), APP_PORT);
    Ok(pod.netns.run(move || TcpListener::bind(any))??)
}
