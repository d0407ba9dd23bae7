//! Serving the control socket.

use std::{
    collections::BTreeMap,
    io,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{UnixListener, UnixStream},
    sync::{OwnedSemaphorePermit, Semaphore, oneshot},
};
use tracing::{debug, warn};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
};

use super::{MAX_MESSAGE, Request, Response};
use crate::{handover::Giver, inspect::AgentView, logging::Chain, telemetry::Metrics};

/// How long a client may take to send its whole request; one that
/// connects and stays silent is closed after this.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Control connections served at once (each holds a descriptor, and an
/// enrollment waits its turn at the actor). Beyond it the oldest client
/// that has sent nothing is closed for the newcomer; if every one has sent
/// something, the newcomer is refused at once.
pub const MAX_CLIENTS: usize = 128;

/// A control socket bound beside its path, not yet reachable there.
#[derive(Debug)]
pub struct StagedSocket {
    /// The bound socket; taken by `publish`.
    listener: Option<UnixListener>,
    staged: PathBuf,
    path: PathBuf,
}

impl StagedSocket {
    /// Moves the socket onto its path in one step (`rename`): clients see
    /// the previous socket (a dead agent's, or the one this agent takes
    /// over from) until then, and this one from then on, never no socket.
    pub fn publish(mut self) -> io::Result<UnixListener> {
        std::fs::rename(&self.staged, &self.path)?;
        self.listener
            .take()
            .ok_or_else(|| io::Error::other("the control socket was published already"))
    }
}

impl Drop for StagedSocket {
    fn drop(&mut self) {
        // Not published (start-up failed): the staged name is ours alone.
        if self.listener.is_some() {
            let _ = std::fs::remove_file(&self.staged);
        }
    }
}

/// Binds the control socket for `path` (mode 0600) under a name of this
/// process beside it; [`StagedSocket::publish`] moves it onto `path`.
pub fn bind(path: &Path) -> io::Result<StagedSocket> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    let mut staged = path.as_os_str().to_owned();
    staged.push(format!(".{}", std::process::id()));
    let staged = PathBuf::from(staged);
    // Left by an earlier process of this pid (pids are reused).
    let _ = std::fs::remove_file(&staged);
    let listener = UnixListener::bind(&staged)?;
    let socket = StagedSocket {
        listener: Some(listener),
        staged,
        path: path.to_path_buf(),
    };
    std::fs::set_permissions(&socket.staged, std::fs::Permissions::from_mode(0o600))?;
    Ok(socket)
}

/// The control connections served now, a slot each. Those that have sent
/// nothing yet are kept in acceptance order: when every slot is taken, the
/// oldest of them gives its slot to the newcomer, so clients that merely
/// connect (a flood, or ones that hang) can never lock out a request such
/// as the CNI plugin's ADD, on which a pod's sandbox creation waits. Only
/// when every slot holds a client that sent something is the newcomer
/// refused.
struct Clients {
    slots: Arc<Semaphore>,
    silent: Mutex<BTreeMap<u64, Silent>>,
    next: AtomicU64,
    metrics: ClientMetrics,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

/// What `/metrics` says of the control socket's clients.
#[derive(Debug, Default)]
struct ClientMetrics {
    /// Clients served now: `silent` (nothing sent yet, may be shed) and
    /// `busy`.
    served: Family<StateLabels, Gauge>,
    /// Silent clients closed to make room for a newcomer.
    shed: Counter,
    /// Newcomers refused because every client served was busy.
    refused: Counter,
}

impl ClientMetrics {
    fn registered(metrics: &Metrics) -> Self {
        let this = Self::default();
        metrics.register(
            "dataplane_control_clients",
            "Control socket clients served now: silent (sent nothing yet; the oldest is closed \
             when a newcomer finds every slot taken) or busy",
            None,
            this.served.clone(),
        );
        metrics.register(
            "dataplane_control_clients_shed",
            "Control socket clients closed, having sent nothing, to make room for a newer one",
            None,
            this.shed.clone(),
        );
        metrics.register(
            "dataplane_control_clients_refused",
            "Control socket clients refused at once because every slot held a busy client",
            None,
            this.refused.clone(),
        );
        this
    }

    fn gauge(&self, state: &'static str) -> Gauge {
        self.served.get_or_create_owned(&StateLabels { state })
    }
}

/// A served client that has sent nothing yet.
struct Silent {
    slot: OwnedSemaphorePermit,
    shed: oneshot::Sender<()>,
}

impl Clients {
    fn new(metrics: &Metrics) -> Self {
        let metrics = ClientMetrics::registered(metrics);
        // Both series exist from the start, at 0.
        metrics.gauge(SILENT);
        metrics.gauge(BUSY);
        Self {
            slots: Arc::new(Semaphore::new(MAX_CLIENTS)),
            silent: Mutex::new(BTreeMap::new()),
            next: AtomicU64::new(0),
            metrics,
        }
    }

    fn silent(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Silent>> {
        self.silent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A slot for a new client: a free one, else the oldest silent
    /// client's (that client is told to go). `None` when every client
    /// served has sent something.
    fn admit(&self) -> Option<(u64, oneshot::Receiver<()>)> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (shed, told) = oneshot::channel();
        let mut silent = self.silent();
        let slot = match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(slot) => {
                self.metrics.gauge(SILENT).inc();
                slot
            }
            Err(_) => {
                let Some((_, oldest)) = silent.pop_first() else {
                    self.metrics.refused.inc();
                    return None;
                };
                // Its task may be gone already (it timed out and is on its
                // way out): the slot is free for the newcomer either way.
                let _ = oldest.shed.send(());
                self.metrics.shed.inc();
                oldest.slot
            }
        };
        silent.insert(id, Silent { slot, shed });
        Some((id, told))
    }

    /// The client `id` sent something (or is leaving): it keeps its slot
    /// from now on, outside the silent ones. `None` if it was shed first.
    fn claim(&self, id: u64) -> Option<Slot> {
        let slot = self.silent().remove(&id)?.slot;
        self.metrics.gauge(SILENT).dec();
        let busy = self.metrics.gauge(BUSY);
        busy.inc();
        Some(Slot {
            _permit: slot,
            busy,
        })
    }
}

/// The gauge labels of [`ClientMetrics::served`].
const SILENT: &str = "silent";
const BUSY: &str = "busy";

/// A busy client's slot, given back when it is dropped.
struct Slot {
    _permit: OwnedSemaphorePermit,
    busy: Gauge,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.busy.dec();
    }
}

/// Answers requests until the task is dropped; `handOver` requests go to
/// `giver`.
pub async fn serve(listener: UnixListener, view: Arc<AgentView>, giver: Arc<Giver>) {
    let clients = Arc::new(Clients::new(&view.mesh.metrics));
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let Some((id, shed)) = clients.admit() else {
                    // Counted in dataplane_control_clients_refused.
                    warn!(
                        max = MAX_CLIENTS,
                        "too many control connections with requests in progress; refusing one"
                    );
                    let reply = refused(format!(
                        "the agent is serving {MAX_CLIENTS} control connections already; retry"
                    ));
                    // One attempt that cannot wait, then the descriptor goes:
                    // a flood must not hold tasks or descriptors of its own.
                    if let Ok(bytes) = serde_json::to_vec(&reply) {
                        let _ = stream.try_write(&bytes);
                    }
                    continue;
                };
                let view = Arc::clone(&view);
                let giver = Arc::clone(&giver);
                let clients = Arc::clone(&clients);
                tokio::spawn(async move {
                    if let Err(err) = answer(stream, (id, shed), &clients, &view, giver).await {
                        debug!(error = %err, "control connection failed");
                    }
                });
            }
            Err(err) => warn!(error = %err, "control socket accept failed"),
        }
    }
}

async fn answer(
    mut stream: UnixStream,
    (id, shed): (u64, oneshot::Receiver<()>),
    clients: &Clients,
    view: &AgentView,
    giver: Arc<Giver>,
) -> io::Result<()> {
    let deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT;
    // The first bytes are read, not merely waited for: readiness alone
    // can be spurious, and a client must not keep its slot for good
    // without having sent anything.
    let mut first = [0u8; 4096];
    let read = tokio::select! {
        read = tokio::time::timeout_at(deadline, stream.read(&mut first)) => read,
        _ = shed => {
            debug!("control client sent nothing while every slot was taken; shed for a newer one");
            let reply = refused(format!(
                "the agent is serving {MAX_CLIENTS} control connections and closed this one, which had sent nothing; retry"
            ));
            if let Ok(bytes) = serde_json::to_vec(&reply) {
                let _ = stream.try_write(&bytes);
            }
            return Ok(());
        }
    };
    // Held until the answer is written, whatever happens below.
    let Some(_slot) = clients.claim(id) else {
        // Shed just as its first bytes came: the newcomer has the slot.
        return Ok(());
    };
    let Ok(read) = read else {
        debug!("control client sent nothing in time; closing");
        return Ok(());
    };
    let mut body = first.get(..read?).unwrap_or_default().to_vec();
    if !body.is_empty() {
        let mut limited = (&mut stream).take(MAX_MESSAGE + 1 - body.len() as u64);
        match tokio::time::timeout_at(deadline, limited.read_to_end(&mut body)).await {
            Ok(result) => {
                result?;
            }
            Err(_) => {
                debug!("control client sent no complete request in time; closing");
                return Ok(());
            }
        }
    }
    let response = match super::read_request(&body) {
        Ok(Request::HandOver { pid }) => {
            giver.give(stream, pid).await;
            return Ok(());
        }
        Ok(request) => handle(request, view).await,
        Err(refusal) => refused(refusal),
    };
    let reply = serde_json::to_vec(&response).map_err(io::Error::from)?;
    stream.write_all(&reply).await?;
    stream.shutdown().await
}

async fn handle(request: Request, view: &AgentView) -> Response {
    let report = |value: Result<serde_json::Value, serde_json::Error>| match value {
        Ok(value) => Response {
            ok: true,
            report: Some(value),
            ..Response::default()
        },
        Err(err) => refused(format!("cannot encode the report: {err}")),
    };
    // Enrollment commands wait for the enrollment actor; reports and the
    // pod list read its last published state.
    match request {
        Request::Status => report(serde_json::to_value(view.status())),
        Request::ConfigDump => report(Ok(view.config_dump())),
        Request::Certs => report(serde_json::to_value(view.certs())),
        Request::Add { pod } => match view.enroller.add(*pod).await {
            Ok(status) => Response {
                ok: true,
                pods: vec![status],
                ..Response::default()
            },
            Err(err) => refused(Chain(&err).to_string()),
        },
        Request::Remove { uid, netns } => {
            let result = match (uid, netns) {
                (Some(uid), _) => view.enroller.remove(uid).await,
                (None, Some(netns)) => view
                    .enroller
                    .remove_by_netns(netns)
                    .await
                    .map(|r| r.is_some()),
                (None, None) => return refused("remove needs a uid or a netns".into()),
            };
            match result {
                Ok(removed) => Response {
                    ok: true,
                    removed: Some(removed),
                    ..Response::default()
                },
                Err(err) => refused(Chain(&err).to_string()),
            }
        }
        // Answered in `answer`, with the stream.
        Request::HandOver { .. } => refused("hand-over is answered on its own".into()),
        Request::List => Response {
            ok: true,
            pods: view.enroller.view().snapshot().pods.clone(),
            ..Response::default()
        },
    }
}

fn refused(error: String) -> Response {
    Response {
        ok: false,
        error: Some(error),
        ..Response::default()
    }
}
