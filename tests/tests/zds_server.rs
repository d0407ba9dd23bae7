//! The ZDS server (`dataplane_user::zds`) against a client that speaks the
//! protocol as ztunnel does (`dataplane_tests::zds_client`), over real unix
//! seqpacket sockets, handing over real network namespaces.
//!
//! Timeouts here are liveness bounds; the short `io_timeout` some tests
//! set is the behaviour under test (a silent peer is dropped), not a speed
//! expectation.

#[path = "zds_server/snapshots.rs"]
mod snapshots;

#[path = "zds_server/misbehaviour.rs"]
mod misbehaviour;

#[path = "zds_server/stock_ztunnel.rs"]
mod stock_ztunnel;

use std::{
    path::PathBuf,
    sync::{Mutex, mpsc},
    thread,
    time::Duration,
};

use anyhow::{Context as _, anyhow, ensure};
use dataplane_tests::{
    Netns, TempDir,
    zds_client::{ZdsClient, ZdsRequest, inode_of_fd, inode_of_path},
};
use dataplane_user::{
    istio_api::zds::{Ack, WorkloadResponse, ZdsHello, workload_response},
    zds::{
        AddOutcome, PodZdsState, ZdsConfig, ZdsError, ZdsHandle, ZdsObserver, ZdsPod, ZdsServer,
        ZtunnelPeer,
    },
};
use prost::Message as _;

/// Liveness bound for anything a test waits for.
const WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Acked(String, ZtunnelPeer),
    Disconnected(ZtunnelPeer),
}

struct Recorder(Mutex<mpsc::Sender<Event>>);

impl ZdsObserver for Recorder {
    fn acked(&self, uid: &str, peer: &ZtunnelPeer) {
        let _ = self
            .0
            .lock()
            .map(|tx| tx.send(Event::Acked(uid.to_owned(), *peer)));
    }
    fn disconnected(&self, peer: &ZtunnelPeer) {
        let _ = self.0.lock().map(|tx| tx.send(Event::Disconnected(*peer)));
    }
}

/// A server on its own runtime, with the observer's events.
struct Server {
    server: Option<ZdsServer>,
    handle: ZdsHandle,
    socket: PathBuf,
    events: mpsc::Receiver<Event>,
    runtime: tokio::runtime::Runtime,
    _dir: TempDir,
}

impl Server {
    fn start(tune: impl FnOnce(&mut ZdsConfig), initial: Vec<ZdsPod>) -> anyhow::Result<Self> {
        let dir = TempDir::new("zds")?;
        let socket = dir.path().join("ztunnel.sock");
        let mut config = ZdsConfig {
            socket: socket.clone(),
            io_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(20),
            ..ZdsConfig::default()
        };
        tune(&mut config);
        Self::start_at(dir, config, initial)
    }

    fn start_at(dir: TempDir, config: ZdsConfig, initial: Vec<ZdsPod>) -> anyhow::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let (tx, events) = mpsc::channel();
        let socket = config.socket.clone();
        let server = {
            let _entered = runtime.enter();
            ZdsServer::start(
                config,
                std::sync::Arc::new(Recorder(Mutex::new(tx))),
                initial,
            )?
        };
        Ok(Self {
            handle: server.handle(),
            server: Some(server),
            socket,
            events,
            runtime,
            _dir: dir,
        })
    }

    fn event(&self) -> anyhow::Result<Event> {
        self.events
            .recv_timeout(WAIT)
            .map_err(|e| anyhow!("no observer event within {WAIT:?}: {e}"))
    }

    fn connect(&self) -> anyhow::Result<ZdsClient> {
        ZdsClient::connect(&self.socket)
    }

    /// Runs `add` on a plain thread (as the enrollment actor calls it)
    /// while the test thread plays ztunnel.
    fn add_in_background(&self, pod: ZdsPod) -> thread::JoinHandle<Result<AddOutcome, ZdsError>> {
        let handle = self.handle.clone();
        thread::spawn(move || handle.add_blocking(pod))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(server) = self.server.take() {
            self.runtime.block_on(server.shutdown());
        }
    }
}

/// A pod with a network namespace of its own.
fn pod(uid: &str) -> anyhow::Result<(Netns, ZdsPod)> {
    let ns = Netns::new("zds")?;
    let netns = std::fs::File::open(ns.path())?.into();
    let pod = ZdsPod {
        uid: uid.to_owned(),
        name: format!("{uid}-name"),
        namespace: "shop".into(),
        service_account: format!("{uid}-sa"),
        ips: vec![],
        netns,
    };
    Ok((ns, pod))
}

fn join<T>(thread: thread::JoinHandle<T>) -> anyhow::Result<T> {
    thread
        .join()
        .map_err(|_| anyhow!("the caller thread panicked"))
}

/// Checks an Add names `uid`'s pod and carries `ns` itself.
fn check_add(request: &ZdsRequest, uid: &str, ns: &Netns) -> anyhow::Result<()> {
    let ZdsRequest::Add {
        uid: got,
        name,
        namespace,
        service_account,
        netns,
    } = request
    else {
        anyhow::bail!("expected an Add of {uid}, got {request:?}");
    };
    ensure!(got == uid, "Add of {got}, expected {uid}");
    ensure!(name == &format!("{uid}-name") && namespace == "shop");
    ensure!(service_account == &format!("{uid}-sa"));
    ensure!(
        inode_of_fd(netns)? == inode_of_path(ns.path())?,
        "the descriptor sent with {uid} is not its network namespace"
    );
    Ok(())
}

fn ack_bytes(error: &str) -> Vec<u8> {
    WorkloadResponse {
        payload: Some(workload_response::Payload::Ack(Ack {
            error: error.into(),
        })),
    }
    .encode_to_vec()
}
