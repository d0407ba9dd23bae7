//! The ZDS server (`dataplane_user::zds`) against a client that speaks the
//! protocol as ztunnel does (`dataplane_tests::zds_client`), over real unix
//! seqpacket sockets, handing over real network namespaces.
//!
//! Timeouts here are liveness bounds; the short `io_timeout` some tests
//! set is the behaviour under test (a silent peer is dropped), not a speed
//! expectation.

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

#[test]
fn zds_hello_gets_a_snapshot_of_registered_pods_with_their_namespaces() -> anyhow::Result<()> {
    let (ns_a, pod_a) = pod("a")?;
    let (ns_b, pod_b) = pod("b")?;
    let (ns_c, pod_c) = pod("c")?;
    let server = Server::start(|_| {}, vec![pod_a])?;
    assert_eq!(server.handle.add_blocking(pod_b)?, AddOutcome::NoZtunnel);
    // A blocking call from async code is refused, not deadlocked.
    let (_ns_d, pod_d) = pod("d")?;
    let refused = server
        .runtime
        .block_on(async { server.handle.add_blocking(pod_d) });
    assert!(
        matches!(refused, Err(ZdsError::Runtime { .. })),
        "{refused:?}"
    );

    let mut ztunnel = server.connect()?;
    let snapshot = ztunnel.ack_snapshot()?;
    assert_eq!(snapshot.len(), 2, "{snapshot:?}");
    check_add(&snapshot[0], "a", &ns_a)?;
    check_add(&snapshot[1], "b", &ns_b)?;
    let me = i32::try_from(std::process::id())?;
    for uid in ["a", "b"] {
        match server.event()? {
            Event::Acked(got, peer) if got == uid && peer.pid == me => {}
            other => anyhow::bail!("expected {uid} acked by pid {me}, got {other:?}"),
        }
    }
    let status = server.handle.status();
    assert_eq!(status.connections.len(), 1);
    assert!(status.connections[0].hello);
    assert_eq!(status.connections[0].peer.pid, me);
    assert!(
        status
            .pods
            .iter()
            .all(|p| matches!(p.state, PodZdsState::Acked { peer, .. } if peer.pid == me)),
        "{status:?}"
    );

    // Later pods come one at a time, after the one SnapshotSent (the
    // client fails on a second).
    let caller = server.add_in_background(pod_c);
    let request = ztunnel.expect()?;
    check_add(&request, "c", &ns_c)?;
    ztunnel.ack()?;
    match join(caller)?? {
        AddOutcome::Acked { peer } => assert_eq!(peer.pid, me),
        other => anyhow::bail!("expected an ack, got {other:?}"),
    }
    Ok(())
}

#[test]
fn zds_later_adds_go_to_the_newest_connection_and_dels_to_all() -> anyhow::Result<()> {
    let server = Server::start(|_| {}, vec![])?;
    let mut old = server.connect()?;
    assert!(old.ack_snapshot()?.is_empty());
    let mut new = server.connect()?;
    assert!(new.ack_snapshot()?.is_empty());
    let status = server.handle.status();
    let (old_id, new_id) = (
        status.connections[0].peer.connection,
        status.connections[1].peer.connection,
    );

    let (ns_p, pod_p) = pod("p")?;
    let caller = server.add_in_background(pod_p);
    check_add(&new.expect()?, "p", &ns_p)?;
    new.ack()?;
    match join(caller)?? {
        AddOutcome::Acked { peer } => assert_eq!(peer.connection, new_id),
        other => anyhow::bail!("expected an ack from the newest connection, got {other:?}"),
    }
    assert!(
        matches!(server.event()?, Event::Acked(uid, peer) if uid == "p" && peer.connection == new_id)
    );

    let handle = server.handle.clone();
    let deleter = thread::spawn(move || handle.del_blocking("p"));
    // The old connection's first request after its snapshot is the Del:
    // it never saw the Add.
    for ztunnel in [&mut old, &mut new] {
        match ztunnel.expect()? {
            ZdsRequest::Del { uid } if uid == "p" => ztunnel.ack()?,
            other => anyhow::bail!("expected Del of p, got {other:?}"),
        }
    }
    let outcome = join(deleter)??;
    assert_eq!((outcome.connections, outcome.acked), (2, 2), "{outcome:?}");
    assert!(server.handle.status().pods.is_empty());

    // The newest goes away: Adds go to the one left.
    drop(new);
    match server.event()? {
        Event::Disconnected(peer) => assert_eq!(peer.connection, new_id),
        other => anyhow::bail!("expected the newest to disconnect, got {other:?}"),
    }
    let (ns_q, pod_q) = pod("q")?;
    let caller = server.add_in_background(pod_q);
    check_add(&old.expect()?, "q", &ns_q)?;
    old.ack()?;
    match join(caller)?? {
        AddOutcome::Acked { peer } => assert_eq!(peer.connection, old_id),
        other => anyhow::bail!("expected an ack from the remaining connection, got {other:?}"),
    }
    Ok(())
}

#[test]
fn zds_a_nacked_add_shows_its_error_and_is_retried_until_acked() -> anyhow::Result<()> {
    let server = Server::start(|c| c.retry_first = Duration::from_millis(100), vec![])?;
    let mut ztunnel = server.connect()?;
    ztunnel.ack_snapshot()?;
    let (ns_p, pod_p) = pod("p")?;
    let error = "failed to bind 15008: address in use";
    let caller = server.add_in_background(pod_p);
    check_add(&ztunnel.expect()?, "p", &ns_p)?;
    ztunnel.nack(error)?;
    assert_eq!(
        join(caller)??,
        AddOutcome::Nacked {
            error: error.into()
        }
    );
    for attempts in 1..=2 {
        // The retry arrives after the status recorded the failure.
        check_add(&ztunnel.expect()?, "p", &ns_p)?;
        let status = server.handle.status();
        match &status.pods[0].state {
            PodZdsState::Failed {
                error: shown,
                attempts: n,
                ..
            } => {
                assert_eq!(shown, error);
                assert_eq!(*n, attempts);
            }
            other => anyhow::bail!("expected the pod failed, got {other:?}"),
        }
        if attempts == 1 {
            ztunnel.nack(error)?;
        } else {
            ztunnel.ack()?;
        }
    }
    match server.event()? {
        Event::Acked(uid, _) => assert_eq!(uid, "p"),
        other => anyhow::bail!("expected p acked, got {other:?}"),
    }
    assert!(matches!(
        server.handle.status().pods[0].state,
        PodZdsState::Acked { .. }
    ));
    Ok(())
}

#[test]
fn zds_an_add_never_acked_times_out_and_the_pod_waits_for_the_next_snapshot() -> anyhow::Result<()>
{
    let server = Server::start(|c| c.io_timeout = Duration::from_secs(1), vec![])?;
    let mut silent = server.connect()?;
    silent.ack_snapshot()?;
    let (ns_p, pod_p) = pod("p")?;
    let caller = server.add_in_background(pod_p);
    check_add(&silent.expect()?, "p", &ns_p)?;
    // No answer: the server gives up and drops the connection.
    assert_eq!(join(caller)??, AddOutcome::TimedOut);
    silent.expect_closed()?;
    assert!(matches!(server.event()?, Event::Disconnected(_)));
    let status = server.handle.status();
    assert!(status.connections.is_empty());
    match &status.pods[0].state {
        PodZdsState::Failed { error, .. } => assert!(error.contains("did not finish"), "{error}"),
        other => anyhow::bail!("expected the pod failed, got {other:?}"),
    }

    let mut ztunnel = server.connect()?;
    let snapshot = ztunnel.ack_snapshot()?;
    assert_eq!(snapshot.len(), 1);
    check_add(&snapshot[0], "p", &ns_p)?;
    Ok(())
}

/// `message` padded to 2,000 bytes with unknown fields (number 15, value
/// 0: two bytes each), so its first 1,024 bytes still decode as `message`:
/// only the truncation itself gives it away.
fn oversized(message: &[u8]) -> Vec<u8> {
    let mut bytes = message.to_vec();
    assert!(
        bytes.len().is_multiple_of(2),
        "padding in pairs needs an even start"
    );
    while bytes.len() < 2000 {
        bytes.extend_from_slice(&[0x78, 0x00]);
    }
    bytes
}

/// One way a peer breaks the protocol, played on a fresh connection.
type Misbehaviour = fn(&mut ZdsClient, &std::os::fd::OwnedFd) -> anyhow::Result<()>;

#[test]
fn zds_misbehaving_peers_are_dropped_and_others_keep_being_served() -> anyhow::Result<()> {
    let (_ns_a, pod_a) = pod("a")?;
    let server = Server::start(|c| c.io_timeout = Duration::from_secs(1), vec![pod_a])?;
    let mut good = server.connect()?;
    assert_eq!(good.ack_snapshot()?.len(), 1);

    let hello = ZdsHello { version: 1 }.encode_to_vec();
    let cases: [(&str, bool, Misbehaviour); 9] = [
        ("says nothing", false, |_, _| Ok(())),
        ("sends garbage", false, |c, _| c.send_raw(&[0xff; 16])),
        ("sends an oversized hello", false, |c, _| {
            c.send_raw(&oversized(&ZdsHello { version: 1 }.encode_to_vec()))
        }),
        ("announces version 2", false, |c, _| {
            c.send_raw(&ZdsHello { version: 2 }.encode_to_vec())
        }),
        ("announces no version", false, |c, _| c.send_raw(&[])),
        ("sends a descriptor", false, |c, fd| {
            c.send_with_fd(&ZdsHello { version: 1 }.encode_to_vec(), fd)
        }),
        ("answers the Add with garbage", true, |c, _| {
            c.expect()?;
            c.send_raw(&[0xff; 16])
        }),
        ("answers the Add with 2000 bytes", true, |c, _| {
            c.expect()?;
            c.send_raw(&oversized(&ack_bytes("")))
        }),
        ("speaks unasked after the snapshot", true, |c, _| {
            c.ack_snapshot()?;
            c.send_raw(&ack_bytes(""))
        }),
    ];
    let some_fd: std::os::fd::OwnedFd = std::fs::File::open("/dev/null")?.into();
    for (what, says_hello, misbehave) in cases {
        let mut peer = ZdsClient::connect_silent(&server.socket)?;
        if says_hello {
            peer.send_raw(&hello)?;
        }
        misbehave(&mut peer, &some_fd).with_context(|| what.to_owned())?;
        peer.expect_closed()
            .with_context(|| format!("a peer that {what} was not dropped"))?;
    }

    // The well-behaved one is still served.
    let status = server.handle.status();
    assert_eq!(status.connections.len(), 1, "{status:?}");
    let (ns_b, pod_b) = pod("b")?;
    let caller = server.add_in_background(pod_b);
    check_add(&good.expect()?, "b", &ns_b)?;
    good.ack()?;
    assert!(matches!(join(caller)??, AddOutcome::Acked { .. }));
    Ok(())
}

#[test]
fn zds_connections_beyond_the_cap_are_refused() -> anyhow::Result<()> {
    let server = Server::start(|c| c.max_connections = 2, vec![])?;
    let mut first = server.connect()?;
    first.ack_snapshot()?;
    let mut second = server.connect()?;
    second.ack_snapshot()?;
    // Refused at accept, before its hello could be read.
    let mut third = ZdsClient::connect_silent(&server.socket)?;
    third.expect_closed()?;
    drop(first);
    assert!(matches!(server.event()?, Event::Disconnected(_)));
    let mut fourth = server.connect()?;
    fourth.ack_snapshot()?;
    assert_eq!(server.handle.status().connections.len(), 2);
    Ok(())
}

#[test]
fn zds_a_stale_socket_file_is_replaced_and_other_files_are_not() -> anyhow::Result<()> {
    let dir = TempDir::new("zds")?;
    let socket = dir.path().join("ztunnel.sock");
    // A socket file left by a previous agent: bound, then its process gone.
    drop(std::os::unix::net::UnixListener::bind(&socket)?);
    assert!(socket.exists());
    let config = ZdsConfig {
        socket: socket.clone(),
        ..ZdsConfig::default()
    };
    let server = Server::start_at(dir, config.clone(), vec![])?;
    server.connect()?.ack_snapshot()?;
    drop(server);
    assert!(!socket.exists(), "the socket file outlived the server");

    let dir = TempDir::new("zds")?;
    let not_socket = dir.path().join("ztunnel.sock");
    std::fs::write(&not_socket, "keep me")?;
    let config = ZdsConfig {
        socket: not_socket.clone(),
        ..config
    };
    match Server::start_at(dir, config, vec![]) {
        Err(e) => assert!(
            matches!(
                e.downcast_ref::<ZdsError>(),
                Some(ZdsError::NotASocket { .. })
            ),
            "{e:#}"
        ),
        Ok(_) => anyhow::bail!("the server replaced a regular file"),
    }
    Ok(())
}

#[test]
fn zds_a_reconnecting_ztunnel_gets_the_snapshot_again_and_the_observer_hears() -> anyhow::Result<()>
{
    let (ns_p, pod_p) = pod("p")?;
    let server = Server::start(|_| {}, vec![pod_p])?;
    let mut first = server.connect()?;
    check_add(&first.ack_snapshot()?[0], "p", &ns_p)?;
    let Event::Acked(_, first_peer) = server.event()? else {
        anyhow::bail!("expected an ack event");
    };
    // ztunnel restarts.
    drop(first);
    assert_eq!(server.event()?, Event::Disconnected(first_peer));
    assert!(matches!(
        server.handle.status().pods[0].state,
        PodZdsState::Waiting
    ));

    let mut second = server.connect()?;
    check_add(&second.ack_snapshot()?[0], "p", &ns_p)?;
    match server.event()? {
        Event::Acked(uid, peer) => {
            assert_eq!(uid, "p");
            assert_ne!(peer.connection, first_peer.connection);
        }
        other => anyhow::bail!("expected p acked again, got {other:?}"),
    }
    // Forgotten pods are not in the next snapshot.
    let handle = server.handle.clone();
    let deleter = thread::spawn(move || handle.del_blocking("p"));
    assert!(matches!(second.expect()?, ZdsRequest::Del { .. }));
    second.ack()?;
    join(deleter)??;
    drop(second);
    let mut third = server.connect()?;
    assert!(third.ack_snapshot()?.is_empty());
    Ok(())
}

/// A stock Istio ztunnel (in-pod mode) against this server: it connects,
/// gets the pod's namespace in the snapshot, binds its listeners there and
/// acks; restarted, it gets the snapshot again; a Del takes the listeners
/// away. Needs a ztunnel binary, so it runs only by hand:
/// `DATAPLANE_ZTUNNEL=/path/to/ztunnel cargo test -p dataplane-tests --test
/// zds_server -- --ignored stock_ztunnel --nocapture`.
#[test]
#[ignore = "needs a ztunnel binary in DATAPLANE_ZTUNNEL"]
fn zds_stock_ztunnel_binds_its_listeners_in_the_pod() -> anyhow::Result<()> {
    let binary = std::env::var_os("DATAPLANE_ZTUNNEL")
        .ok_or_else(|| anyhow!("set DATAPLANE_ZTUNNEL to a ztunnel binary"))?;
    let (pod_ns, pod_p) = pod("p")?;
    pod_ns.ip(&["addr", "add", "10.99.0.2/32", "dev", "lo"])?;
    let node = Netns::new("zds-node")?;
    let server = Server::start(|_| {}, vec![pod_p])?;
    let dir = server._dir.path().to_owned();
    let config = dir.join("ztunnel.yaml");
    std::fs::write(
        &config,
        "workloads:\n- uid: cluster1//v1/Pod/shop/p-name\n  name: p-name\n  namespace: shop\n  \
         serviceAccount: p-sa\n  workloadIps: [\"10.99.0.2\"]\n  protocol: HBONE\n  node: node1\n  \
         network: \"\"\n  services: {}\n",
    )?;
    // As Istio's chart starts it, minus istiod: local config, a fake CA.
    let start = |run: u32| -> anyhow::Result<(dataplane_tests::ChildGuard, Option<i32>)> {
        let log = std::fs::File::create(dir.join(format!("ztunnel-{run}.log")))?;
        let mut command = std::process::Command::new("ip");
        command
            .args(["netns", "exec", node.name()])
            .arg(&binary)
            .env("INPOD_UDS", &server.socket)
            .env("LOCAL_XDS_PATH", &config)
            .env("XDS_ADDRESS", "")
            .env("FAKE_CA", "true")
            .env("NODE_NAME", "node1")
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = dataplane_tests::ChildGuard::new(command.spawn()?);
        let pid = child.id().and_then(|p| i32::try_from(p).ok());
        Ok((child, pid))
    };
    let listening = |port: &str| -> anyhow::Result<bool> {
        let ss = dataplane_tests::run(
            "ip",
            &[
                "netns",
                "exec",
                pod_ns.name(),
                "ss",
                "-Hltn",
                "sport",
                "=",
                port,
            ],
        )?;
        Ok(!ss.trim().is_empty())
    };
    let acked_with_listeners = |pid: Option<i32>| -> anyhow::Result<()> {
        match server.event()? {
            Event::Acked(uid, peer) => {
                ensure!(uid == "p");
                ensure!(
                    Some(peer.pid) == pid,
                    "acked by {peer:?}, ztunnel is {pid:?}"
                );
            }
            other => anyhow::bail!("expected ztunnel to ack p, got {other:?}"),
        }
        for port in [":15001", ":15006", ":15008"] {
            ensure!(
                listening(port)?,
                "ztunnel acked but nothing listens on {port} in the pod"
            );
        }
        Ok(())
    };
    let outcome = (|| -> anyhow::Result<()> {
        let (first, first_pid) = start(1)?;
        acked_with_listeners(first_pid)?;
        drop(first);
        match server.event()? {
            Event::Disconnected(peer) => ensure!(Some(peer.pid) == first_pid),
            other => anyhow::bail!("expected ztunnel's disconnection, got {other:?}"),
        }
        let (second, second_pid) = start(2)?;
        acked_with_listeners(second_pid)?;
        let outcome = server.handle.del_blocking("p")?;
        ensure!(outcome.acked == 1, "{outcome:?}");
        let deadline = std::time::Instant::now() + WAIT;
        while listening(":15008")? {
            ensure!(
                std::time::Instant::now() < deadline,
                "ztunnel kept its listeners after Del"
            );
            thread::sleep(Duration::from_millis(50));
        }
        drop(second);
        Ok(())
    })();
    for run in [1, 2] {
        if let Ok(log) = std::fs::read_to_string(dir.join(format!("ztunnel-{run}.log"))) {
            let zds_lines: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("inpod") || l.contains("pod ") || l.contains("snapshot"))
                .collect();
            eprintln!("ztunnel run {run}, ZDS lines:\n{}", zds_lines.join("\n"));
        }
    }
    outcome
}
