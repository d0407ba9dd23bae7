//! Serving the control socket.

use std::{
    io,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{UnixListener, UnixStream},
};
use tracing::{debug, warn};

use super::{MAX_MESSAGE, Request, Response};
use crate::{handover::Giver, inspect::AgentView, logging::Chain};

/// How long a client may take to send its whole request; one that
/// connects and stays silent is closed after this.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// Control connections served at once; more are refused at once (each
/// holds a descriptor, and an enrollment waits its turn at the actor).
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

/// Answers requests until the task is dropped; `handOver` requests go to
/// `giver`.
pub async fn serve(listener: UnixListener, view: Arc<AgentView>, giver: Arc<Giver>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CLIENTS));
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                    warn!(
                        max = MAX_CLIENTS,
                        "too many control connections; refusing one"
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
                tokio::spawn(async move {
                    if let Err(err) = answer(stream, &view, giver).await {
                        debug!(error = %err, "control connection failed");
                    }
                    drop(slot);
                });
            }
            Err(err) => warn!(error = %err, "control socket accept failed"),
        }
    }
}

async fn answer(mut stream: UnixStream, view: &AgentView, giver: Arc<Giver>) -> io::Result<()> {
    let mut body = Vec::new();
    let mut limited = (&mut stream).take(MAX_MESSAGE + 1);
    match tokio::time::timeout(REQUEST_TIMEOUT, limited.read_to_end(&mut body)).await {
        Ok(result) => {
            result?;
        }
        Err(_) => {
            debug!("control client sent no complete request in time; closing");
            return Ok(());
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
